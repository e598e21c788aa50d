"""The errors every layer raises for a user's files: one line, exit 2 (backend.shared.cli_contract)."""


class CheckpointError(ValueError):
    """The checkpoint directory is missing, incomplete or unreadable."""
