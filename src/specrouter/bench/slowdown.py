"""A scripted slowdown of one pool model (a co-tenant, thermal throttling), for the benchmark.

While `active`, every forward of the model is followed by a sleep of (factor - 1) times its own
measured duration, so it runs `factor` times slower as seen from outside, whichever system calls
it: the native runner (its `forward`), the n-gram drafter (its `propose`), and the model's
transformers twin (forward hooks). The engine times forwards around the call, so the router sees
the slowdown in its cost profile exactly as it would see a real one.
"""

from __future__ import annotations

import time


class Slowdown:
    """Makes pool model `model` `factor` times slower while `active` (installed by `install`)."""

    def __init__(self, model: str, factor: float):
        if not factor >= 1.0:
            raise ValueError(f"slowdown factor must be >= 1, got {factor!r}")
        self.model, self.factor = model, float(factor)
        self.active = False
        self._patched: list[tuple[object, str]] = []  # (object, attribute) wrapped in place
        self._hooks: list = []

    def _sleep_after(self, seconds: float) -> None:
        if self.active:
            time.sleep((self.factor - 1.0) * seconds)

    def _wrap(self, obj, attr: str) -> None:
        inner = getattr(obj, attr)

        def slowed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self._sleep_after(time.perf_counter() - t0)
            return out

        setattr(obj, attr, slowed)  # an instance attribute shadows the class's method
        self._patched.append((obj, attr))

    def install(self, pool, hf_models: dict | None = None) -> "Slowdown":
        """Wrap the model in `pool` (runner or model-free drafter) and its transformers twin in
        `hf_models` (pool name -> model), if loaded."""
        if self.model in pool.runners:
            self._wrap(pool.runners[self.model], "forward")
        elif self.model in pool.drafters:
            self._wrap(pool.drafters[self.model], "propose")
        else:
            raise ValueError(f"no model {self.model!r} in the pool {pool.order}")
        hf = (hf_models or {}).get(self.model)
        if hf is not None:
            start: list[float] = []
            self._hooks.append(hf.register_forward_pre_hook(lambda m, a: start.append(time.perf_counter())))
            self._hooks.append(hf.register_forward_hook(
                lambda m, a, o: self._sleep_after(time.perf_counter() - start.pop())))
        return self

    def remove(self) -> None:
        """Undo `install`."""
        for obj, attr in self._patched:
            delattr(obj, attr)
        for h in self._hooks:
            h.remove()
        self._patched, self._hooks, self.active = [], [], False
