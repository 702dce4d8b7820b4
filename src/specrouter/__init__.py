"""SpecRouter: adaptive multi-level speculative decoding."""

__version__ = "0.1.0"

from specrouter.api import GenerationResult, SpecRouter  # noqa: E402
from specrouter.config import SamplingParams  # noqa: E402
from specrouter.errors import (  # noqa: E402
    ChainError,
    CheckpointError,
    ContextLengthError,
    SamplingParamsError,
    SpecRouterError,
    VocabularyMismatchError,
)

__all__ = [
    "SpecRouter", "GenerationResult", "SamplingParams", "SpecRouterError", "CheckpointError",
    "VocabularyMismatchError", "ContextLengthError", "SamplingParamsError", "ChainError",
]
