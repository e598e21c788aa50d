"""The one error type the converters raise for bad input or output; the CLI prints it in one line."""

from backend.model.families import ConfigError
from backend.shared.errors import CheckpointError
from converters.table import MappingError


class ConversionError(ValueError):
    """Input or output the converters cannot use; the message names the problem and the fix."""


# Errors that are the user's input, not a bug: one line, exit code 2.
USER_ERRORS = (ConversionError, CheckpointError, ConfigError, MappingError)
