"""The shared records: the plain dataclasses every layer may import (the bottom layer; it imports
nothing of the package).

- `stats.py`: what a cycle and a request did (`CycleStats`, `RequestStats`).
- `routing.py`: what the router is told about a row and answers (`RowContext`, `RowOutcome`,
  `ForwardRecord`, `Decision`, `DecisionEvent`), and the `Chain` / `Pair` aliases.
"""
