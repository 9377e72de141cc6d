"""Errors raised on bad input. Each message names the argument, the value and what is allowed.

They subclass ``ValueError`` so callers that only know the standard library can still catch them.
"""


class MoeinfraError(ValueError):
    """Base class of every error moeinfra raises for bad input."""


class InputError(MoeinfraError):
    """An argument has a value outside what is allowed."""


class TraceFormatError(MoeinfraError):
    """A trace file cannot be read (truncated JSON, wrong structure, ...)."""


class CheckpointError(InputError):
    """A checkpoint folder cannot be used; the message names the file (and tensor)."""
