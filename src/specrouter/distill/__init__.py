"""Distillation of a draft from the target: corpora (`corpus.py`), the loss (`loss.py`),
training (`train.py`) and held-out evaluation (`evaluate.py`)."""
