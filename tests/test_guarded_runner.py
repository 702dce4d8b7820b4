"""A `GuardedRunner` (engine/faults.py, the server's wrapper) behaves like the runner it wraps:
every attribute `ModelRunner` defines reads the wrapped runner's (inherited, the base class's
defaults shadowed them: a guarded native runner claimed it pads ragged batches and could not
copy slots or report its KV size), and every model call it has (`forward`,
`forward_with_features`, a head's `step`) is guarded, on the caller's thread, under the watch."""

import threading

import pytest

from specrouter.config import SamplingParams
from specrouter.engine.engine import Engine
from specrouter.engine.faults import GUARDED_CALLS, ForwardWatch, GuardedRunner, ModelFailure, guard_runners
from specrouter.models.pool import Pool
from specrouter.models.runners.base import ModelRunner
from specrouter.models.runners.kernels import rowinv, why_not_native

NAMES = ("draft", "target")
# shared prefixes (the prefix cache adopts them) and ragged lengths (packed by the native runner)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, 10, 40], [40, 41, 42],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 201]]


def native_pool(dirs) -> Pool:
    if why_not_native() is not None:
        pytest.skip(why_not_native())
    assert rowinv() is not None, "the native kernels are claimed here but did not build"
    return Pool.load([dirs[n] for n in NAMES], names=list(NAMES), target="target", dtype="float32")


def base_attributes() -> list[str]:
    return [a for a in vars(ModelRunner) if not a.startswith(("__", "_abc"))]


def test_every_base_attribute_reads_the_wrapped_runner(tiny_pool_dirs):
    pool = native_pool(tiny_pool_dirs)
    Engine(pool, max_num_seqs=2, max_model_len=64)  # registers the prefix cache (`parking`)
    inner = pool.runners["target"]
    guarded = GuardedRunner(inner, ForwardWatch(5.0))
    # the control: these differ from the base class's defaults on a native runner
    assert inner.packs_ragged and not ModelRunner.packs_ragged
    assert inner.parking is not None and inner.kv_bytes_per_position() > 0
    for attr in base_attributes():
        mine, theirs = getattr(guarded, attr), getattr(inner, attr)
        if callable(theirs) and hasattr(theirs, "__self__"):  # a bound method: the inner's own
            if attr in ("forward", "reserve", "allocate_slot", "free_slot"):
                continue  # the guard's own (forwarding) methods, checked below by behaviour
            assert mine.__self__ is inner and mine.__func__ is theirs.__func__, attr
        else:
            assert mine == theirs, attr
    # writes reach the wrapped runner too (reserve's generation bump, the cache's parking)
    guarded.generation = inner.generation + 1
    assert inner.generation == guarded.generation
    # and the runner's own attributes, as before
    for attr in ("name", "vocab_size", "max_len", "num_slots", "dtype", "device", "max_context"):
        assert getattr(guarded, attr) == getattr(inner, attr), attr


def run_ragged(pool: Pool) -> tuple[list[list[int]], list, dict]:
    """Greedy outputs of PROMPTS run as one ragged batch, twice (the second pass adopts cached
    prefixes), with every forward the executor recorded and the prefix cache's counters."""
    eng = Engine(pool, max_num_seqs=len(PROMPTS), max_model_len=64)
    forwards = []
    step = eng.executor.step

    def spy(*a, **kw):
        result = step(*a, **kw)
        forwards.extend((f.model, f.rows, f.new_tokens) for f in result.forwards)
        return result

    eng.executor.step = spy
    outs = []
    for _ in range(2):
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True),
                                chain=("draft", "target"), k=3) for p in PROMPTS]
        while eng.has_unfinished():
            eng.step()
        outs.append([s.output_ids for s in seqs])
    stats = eng.prefix_cache.stats
    return outs, forwards, {"hits": stats.hits, "cached": stats.cached_tokens, "copies": stats.copies,
                            "moves": stats.moves, "parked": eng.prefix_cache.parked_bytes}


def test_a_guarded_pool_runs_like_the_bare_one_ragged_and_cached(tiny_pool_dirs):
    bare = run_ragged(native_pool(tiny_pool_dirs))
    pool = native_pool(tiny_pool_dirs)
    pool.runners = guard_runners(pool.runners, ForwardWatch(5.0))
    guarded = run_ragged(pool)
    assert guarded[0] == bare[0]  # the same tokens
    assert guarded[0][0] == guarded[0][1]  # cache hits change nothing
    # the same forwards, costed as packed (a fractional mean width: ragged rows packed)
    assert guarded[1] == bare[1]
    assert any(w != int(w) for _, _, w in bare[1])
    assert guarded[2] == bare[2] and bare[2]["hits"] > 0 and bare[2]["parked"] > 0


def test_every_model_call_is_guarded_and_on_the_callers_thread(tiny_pool_dirs):
    pool = native_pool(tiny_pool_dirs)
    inner = pool.runners["target"]
    assert "forward_with_features" in GUARDED_CALLS and callable(inner.forward_with_features)
    seen = []
    real = inner.forward_with_features

    def spy(batch, *rest):
        seen.append(threading.current_thread().name)
        if len(seen) == 2:
            raise RuntimeError("injected")
        return real(batch, *rest)

    inner.forward_with_features = spy
    watch = ForwardWatch(5.0)
    guarded = GuardedRunner(inner, watch)
    from specrouter.models.runners.base import ForwardBatch

    batch = ForwardBatch.build([0], [0], [[5, 6, 7]], [[2]])
    began = watch.begin
    watched = []
    watch.begin = lambda runner: watched.append(runner) or began(runner)
    logits, features = guarded.forward_with_features(batch)
    assert logits.shape[:2] == (1, 1) and features.shape[:2] == (1, 3)
    assert seen == [threading.current_thread().name] and watched == [guarded]  # here, under the deadline
    with pytest.raises(ModelFailure, match="injected"):
        guarded.forward_with_features(batch)
    assert not watch._inflight  # a raising forward ends its deadline too
    # a runner without the call has none through the guard either
    draft = GuardedRunner(pool.runners["draft"], None)
    assert not hasattr(draft, "step")
