"""Building the router for a pool: the machine's persisted cost profile (a start-up sweep of
the models it does not know yet, with a progress bar, saved for next time) and the policy."""

from __future__ import annotations

import warnings
from pathlib import Path

from specrouter.config import ProfileConfig, RouterConfig
from specrouter.router.policy import Router
from specrouter.router.profile import (
    CostProfile,
    default_profile_path,
    identity_of,
    machine_busy,
    sweep,
)


def load_or_sweep_profile(pool, *, path: str | Path | None = None, progress: bool = True,
                          force: bool = False, config: ProfileConfig | None = None) -> CostProfile:
    """This machine's profile of every pool model; models missing from it are swept now."""
    path = Path(path) if path is not None else default_profile_path()
    models = {**pool.runners, **pool.drafters}
    idents = [identity_of(m) for m in models.values()]
    profile = CostProfile(config) if force else CostProfile.load(path, idents, config=config)
    missing = set(models) if force else {i.name for i in profile.missing(idents)}
    if missing:
        busy = machine_busy()
        sweep({n: r for n, r in pool.runners.items() if n in missing},
              {n: d for n, d in pool.drafters.items() if n in missing},
              profile=profile, progress=progress)
        if busy or machine_busy():
            # timings taken while other processes held the cores: used for this run (the online
            # EMA corrects them), not saved, so the next start sweeps again
            warnings.warn("the cores were busy during the cost-profile sweep: it is used but not "
                          f"saved to {path} (the next start sweeps again)", stacklevel=2)
        else:
            profile.save(path)
    return profile


def build_router(pool, *, profile_path: str | Path | None = None, progress: bool = True,
                 config: RouterConfig | None = None, on_decision=None) -> Router:
    """The adaptive router of `pool` (profiles it first if this machine has no profile)."""
    profile = load_or_sweep_profile(pool, path=profile_path, progress=progress,
                                    config=config.profile if config is not None else None)
    kwargs = {"config": config} if config is not None else {}
    return Router.from_pool(pool, profile, on_decision=on_decision, **kwargs)
