"""Feature-level (EAGLE-style) draft heads at run time: a pool level that reads the target's own
last hidden state (training lives in `specrouter.heads`).

- `model.py`: the head's config, parameters and file format (save / load), and the
  differentiable forward training and evaluation use.
- `runner.py`: the head on the native runner's kernels, one draft step over a slot-addressed KV
  cache.
- `level.py`: the head as a pool level (`HeadLevel`), loaded beside its target.
"""
