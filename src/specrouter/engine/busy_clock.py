"""The engine's busy clock (`BusyClock`): its clock less the time its caller spends between
steps (a server handing a step's tokens to its event loop and waiting for it, an API loop's own
work). Read inside `Engine.step` it is the engine's own time. The router times a step's host
work outside the executor with it (router/host_time.py), so a server's router and the
library's price the same steps the same (docs/serving-performance.md, eleventh round)."""

from __future__ import annotations

from collections.abc import Callable


class BusyClock:
    """`clock()` less the seconds between a step's end (`leave`) and the next one's start (`enter`)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.idle = 0.0  # clock seconds between steps so far
        self.left: float | None = None  # clock time the last step ended

    def __call__(self) -> float:
        return self.clock() - self.idle

    def enter(self) -> None:
        """A step starts: the time since the last one ended was the caller's."""
        if self.left is not None:
            self.idle += self.clock() - self.left

    def leave(self) -> None:
        """A step ended."""
        self.left = self.clock()
