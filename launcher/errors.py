"""Errors a user can act on. `UserError` exits with code 2 and a one-paragraph message."""


class UserError(Exception):
    """Bad input (config, paths, layout): printed without a traceback, exit code 2."""

    exit_code = 2
