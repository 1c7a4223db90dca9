"""Errors of the fast-weight ops."""


class BackendUnavailableError(RuntimeError):
    """A backend was requested that cannot run in this installation."""
