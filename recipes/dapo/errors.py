"""The recipe's one user-facing error: a run that cannot start as asked (exit 2, one line)."""


class LaunchError(RuntimeError):
    """The run cannot start as asked (files, cluster, flags); the message says what to do."""
