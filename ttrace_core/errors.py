"""Errors a user can cause. Each message says what is wrong, where (file, tensor, rank) and what to do.

The CLI maps every `TtraceError` to exit code 2 and prints its message on one line.
"""


class TtraceError(Exception):
    """Base class for problems with user input: traces, layouts, configurations."""


class TraceFormatError(TtraceError):
    """A trace directory or file cannot be read: missing, truncated, corrupted or of another format."""


class LayoutError(TtraceError):
    """Layout metadata is inconsistent or names a placement ttrace cannot map back to a full tensor."""


class ConfigMismatchError(TtraceError):
    """Two runs were produced from different model configurations and cannot be compared."""


class LaunchError(TtraceError):
    """A spawned rank failed or timed out."""

    def __init__(self, message: str, *, killed_by_signal: bool = False) -> None:
        super().__init__(message)
        self.killed_by_signal = killed_by_signal
        """A rank was killed from outside (SIGKILL, the OOM killer): no fault of the run's own code."""


class MapError(TtraceError):
    """A correspondence map (docs/porting.md) cannot be read, or does not fit the runs it relates."""


class TtraceInternalError(Exception):
    """Something failed that the user's input does not explain: the CLI exits 3. Not a TtraceError."""
