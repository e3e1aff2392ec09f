"""Errors the engine raises on bad input.

Every error a caller can provoke with bad input is a `ValueError` subclass whose
message names what was wrong, so a server can turn it into a 400 response.
"""


class EngineError(ValueError):
    """Base class for errors caused by bad input to the engine."""


class CheckpointError(EngineError):
    """The checkpoint folder or file is missing, incomplete or unreadable."""


class UnsupportedArchitectureError(EngineError):
    """The checkpoint's architecture has no model implementation here."""


class PromptTooLongError(EngineError):
    """A prompt does not fit in the model's context."""


class KVBudgetError(EngineError):
    """The KV cache memory budget cannot hold even one full-length sequence."""


class OutOfBlocksError(EngineError):
    """Not enough free KV blocks for the request; nothing was allocated."""
