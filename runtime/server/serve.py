"""`optllm serve`: load the model, then run the API under uvicorn until SIGTERM / Ctrl-C.

The port is checked before the model loads (a busy port is one line, not a minute of loading
first). On SIGTERM uvicorn stops accepting connections and gives in-flight requests
`shutdown_timeout` seconds; then the engine finishes or aborts what is left, and the process
exits 0. The engine runs in a process of its own (runtime/engine_process.py), so the event
loop's work and the engine's host work do not take turns on one GIL.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys

from ...errors import UserError
from ..async_engine import AsyncLLMEngine
from ..config import EngineConfig
from ..engine_process import ProcessEngine
from .app import ServerConfig, build_app

log = logging.getLogger("optllm.server")


def check_port(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise UserError(f"--port {port} is not allowed; allowed: 1..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"--host {host!r} cannot be resolved: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _graceful_server(config):
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """SIGTERM / SIGINT stop the server gracefully and the process then exits 0 (uvicorn's
        own handler re-raises the signal after its graceful shutdown: exit status -15). A second
        Ctrl-C forces the exit."""

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    return GracefulServer(config)


def serve(engine_config: EngineConfig, server_config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 30.0, engine_process: bool = True) -> None:
    """engine_process: the engine in a process of its own (ProcessEngine; the default), else
    on a thread of this one (AsyncLLMEngine: one process, but the event loop and the engine's
    host work share a GIL, which costs throughput under load)."""
    import uvicorn

    check_port(host, port)
    # The thread that hands the engine's outputs to the event loop (the engine itself with
    # --no-engine-process) waits for the GIL once per step; with the event loop busy writing
    # streams, the default 5 ms switch interval could hold it back that long each time.
    # 0.5 ms bounds that wait at a fraction of a decode step.
    sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = ProcessEngine(engine_config) if engine_process else AsyncLLMEngine(engine_config)
    app = build_app(engine, server_config)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout)
    log.info("serving %s as %r on http://%s:%d (OpenAI API under /v1)", engine_config.model,
             server_config.served_model_name, host, port)
    try:
        _graceful_server(config).run()
    finally:
        engine.shutdown(0)  # the lifespan drained it already, unless uvicorn failed to start
    log.info("stopped")
