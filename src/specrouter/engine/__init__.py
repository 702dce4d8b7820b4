"""The engine: continuous batching of rows over the pool (`engine.py`), fault isolation of
failing models (`faults.py`), and per-cycle / per-request statistics (`stats.py`)."""
