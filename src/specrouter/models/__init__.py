"""The pool of models: loading and naming (`pool.py`), the shared tokenizer (`tokenizer.py`),
GGUF conversion (`gguf_convert.py`), the embedded default pool and its assets
(`default_pool.py`, `assets/`), the forward runners (`runners/`) and the run-time draft heads
(`heads/`)."""
