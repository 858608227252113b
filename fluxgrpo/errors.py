"""Errors the CLI turns into one clear line and an exit code.

Every message says what went wrong, why, and what to do (the flag or command that fixes it).
"""


class FluxgrpoError(Exception):
    """A runtime failure the user can act on; the CLI prints it and exits 1."""

    exit_code = 1


class UsageError(FluxgrpoError):
    """Bad flags or inconsistent settings; the CLI prints it and exits 2."""

    exit_code = 2


def not_usable(what: str, problems: list[str], fix: str | None) -> FluxgrpoError:
    """The one message for inputs that failed their check: ``<what> are not usable (<problems>): <fix>``.

    Args:
        what: the inputs and where they are, e.g. "FLUX weights in data/flux".
        problems: each thing found wrong, joined with "; ".
        fix: the command or flag that fixes it.
    """
    return FluxgrpoError(f"{what} are not usable ({'; '.join(problems)}): {fix}")
