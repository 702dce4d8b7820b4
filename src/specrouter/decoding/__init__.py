"""Multi-level collaborative verification (pillar 2): sampling and processed distributions
(`sampling.py`), per-level acceptance (`verification.py`), one cycle of a chain over a batch
(`executor.py`), draft proposals from a head (`head_drafting.py`). The drafters themselves are
`specrouter.drafters`."""
