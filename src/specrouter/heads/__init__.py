"""Feature-level (EAGLE-style) draft heads: a one-layer drafter that reads the target's own
last hidden state instead of re-reading the text with a small independent model.

- `model.py`: the head (config, parameters, the differentiable forward over unrolled draft
  depths used by training and evaluation), save / load.
- `runner.py`: the head on the native runner's kernels, one draft step over a slot-addressed KV
  cache (the seam the engine will use).
- `features.py`: the target's features and greedy labels over a corpus, computed by the native
  runner at the engine's precision.
- `train.py`: `specrouter distill --head` (resumable, recipe, report).
- `evaluate.py`: held-out agreement at draft depths 1..k and mean acceptance lengths, for a head
  and for a standalone draft; step cost against the target's.

Glossary: a target *feature* is the last decoder layer's output at a position, before the final
norm (`LlamaRunner.forward_with_features`); the head consumes and predicts features in that
space and applies the target's frozen final norm on entry and before its vocabulary head.
"""
