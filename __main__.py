from .cli.app import main

if __name__ == "__main__":  # not when a spawned child (the server's engine process) imports it
    main()
