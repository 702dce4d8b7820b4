"""The engine: continuous batching of rows over the pool (`engine.py`), fault isolation of
failing models (`faults.py`), one row's cycle run in isolation (`isolation.py`). Its statistics
records are `specrouter.records.stats`."""
