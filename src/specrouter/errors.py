"""Exceptions raised by SpecRouter. Every user-facing failure is one of these, with a message
that says what was wrong and how to fix it."""


class SpecRouterError(Exception):
    """Base class of all SpecRouter errors."""


class CheckpointError(SpecRouterError):
    """A model checkpoint is missing, incomplete, corrupt or of an unsupported kind."""


class VocabularyMismatchError(SpecRouterError):
    """Models of one pool do not share a tokenizer / vocabulary."""


class ContextLengthError(SpecRouterError):
    """A prompt (plus the tokens to generate) does not fit the context of a pool model."""


class SamplingParamsError(SpecRouterError, ValueError):
    """Invalid sampling parameters (temperature, top_k, top_p, max_new_tokens, ...)."""


class GrammarError(SamplingParamsError):
    """A grammar or JSON schema that cannot constrain decoding (the message names the problem)."""


class ChainError(SpecRouterError, ValueError):
    """An invalid chain: unknown model, target not last, bad draft length."""


class DeviceError(SpecRouterError, ValueError):
    """A device that is not available here (e.g. `device="cuda"` where torch sees no CUDA GPU),
    or a device name that is not one."""
