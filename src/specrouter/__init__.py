"""SpecRouter: adaptive multi-level speculative decoding.

The names below are imported on first use, so `import specrouter.cli.main` (the console
script) starts without loading torch: Ctrl-C during start-up reaches the CLI's handler."""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "SpecRouter": "specrouter.api", "GenerationResult": "specrouter.api",
    "StreamChunk": "specrouter.api",
    "SamplingParams": "specrouter.config", "SpecRouterConfig": "specrouter.config",
    "PoolConfig": "specrouter.config", "EngineConfig": "specrouter.config",
    "RouterConfig": "specrouter.config", "ServerConfig": "specrouter.config",
    "SpecRouterError": "specrouter.errors", "CheckpointError": "specrouter.errors",
    "VocabularyMismatchError": "specrouter.errors", "ContextLengthError": "specrouter.errors",
    "SamplingParamsError": "specrouter.errors", "ChainError": "specrouter.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specrouter' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
