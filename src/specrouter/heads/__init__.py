"""Training feature-level (EAGLE-style) draft heads: a one-layer drafter that reads the target's
own last hidden state instead of re-reading the text with a small independent model. The head at
run time (config and format, runner, pool level) is `specrouter.models.heads`; this package only
trains and evaluates it.

- `features.py`: the target's features and greedy labels over a corpus, computed by the native
  runner at the engine's precision.
- `train.py`: `specrouter distill --head` (resumable, recipe, report).
- `evaluate.py`: held-out agreement at draft depths 1..k and mean acceptance lengths, for a head
  and for a standalone draft; step cost against the target's.

Glossary: a target *feature* is the last decoder layer's output at a position, before the final
norm (`LlamaRunner.forward_with_features`); the head consumes and predicts features in that
space and applies the target's frozen final norm on entry and before its vocabulary head.
"""
