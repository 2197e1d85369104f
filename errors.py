"""The one exception type a user's mistake raises; the CLI prints it as one line."""


class UserError(ValueError):
    """Bad input a user can fix (missing model, unknown scheme, unwritable output...)."""
