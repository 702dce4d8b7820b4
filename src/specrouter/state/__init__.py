"""Synchronized state management (pillar 3): one `Sequence` per request (`sequence.py`) and the
`StateManager` that keeps every model's KV cache of a chain consistent (`manager.py`)."""
