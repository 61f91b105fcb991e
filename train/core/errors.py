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


class StorageError(UserError):
    """A run's file could not be written: the disk (or a quota, or a file-size limit) is full. The trainer stops with
    its own exit code, so a runner does not relaunch into the same full disk; what was written before is intact."""

    exit_code = 4

    @classmethod
    def of(cls, what: str, exc: BaseException) -> "StorageError":
        """`what could not be written: <the OS's reason>` (`[Errno 28] No space left on device`, or the exception's)."""
        reason = (f"[Errno {exc.errno}] {exc.strerror}" if isinstance(exc, OSError) and exc.strerror
                  else " ".join(str(exc).split()) or type(exc).__name__)
        return cls(f"{what} could not be written: {reason}")


class ConversionError(UserError):
    """A model that cannot be exported to, or imported from, the Hugging Face format (train/hf/convert.py)."""
