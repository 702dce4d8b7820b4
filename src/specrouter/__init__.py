"""SpecRouter: adaptive multi-level speculative decoding."""

__version__ = "0.1.0"
