"""Errors the CLI turns into one clear line and an exit code.

Every message says what went wrong, why, and what to do (the flag or command that fixes it).
"""


class FluxgrpoError(Exception):
    """A runtime failure the user can act on; the CLI prints it and exits 1."""

    exit_code = 1


class UsageError(FluxgrpoError):
    """Bad flags or inconsistent settings; the CLI prints it and exits 2."""

    exit_code = 2
