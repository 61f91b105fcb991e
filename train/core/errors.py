"""Errors a user can cause. The entrypoints print them as one line (`print_error`) and exit non-zero."""

import sys


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


def print_error(message: object, file=None) -> None:
    """`error: MESSAGE` on stderr (or `file`) in one write. Ranks under torchrun run `python -u`, where print() writes
    the text and its newline separately: two ranks failing at the same vote printed `error: A error: B` and then two
    newlines. One write of a line shorter than PIPE_BUF reaches a pipe or an appended file whole."""
    stream = sys.stderr if file is None else file
    stream.write(f"error: {message}\n")
    stream.flush()
