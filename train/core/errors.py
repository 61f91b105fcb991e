"""Errors a user can cause. The entrypoints print them as one line and exit non-zero."""


class UserError(Exception):
    """Base class: bad input from the user (config, data, checkpoint, environment)."""

    exit_code = 2


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass


class ConversionError(UserError):
    """A model that cannot be exported to, or imported from, the Hugging Face format (train/hf/convert.py)."""
