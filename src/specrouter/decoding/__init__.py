"""Multi-level collaborative verification (pillar 2): sampling and processed distributions
(`sampling.py`), per-level acceptance (`verification.py`), one cycle of a chain over a batch
(`executor.py`), and the model-free drafters (`drafters/`)."""
