"""Continuous batching at the engine level: rows join and leave between cycles, run different
chains at once, and each row's greedy output equals the row run alone."""

import pytest
import torch

from specrouter.config import SamplingParams
from specrouter.engine.engine import CapacityError, Engine
from specrouter.models.pool import Pool


@pytest.fixture(scope="module")
def pool(tiny_pool_dirs):
    d = tiny_pool_dirs
    names = ["draft", "mid", "target"]
    return Pool.load([d[n] for n in names], names=names, target="target", dtype="float64")


def alone(pool, prompt, n):
    seq = Engine(pool).generate_ids([prompt], [SamplingParams(max_new_tokens=n, ignore_eos=True)],
                                    chain=("target",))[0]
    return seq.output_ids


def test_rows_join_leave_and_mix_chains(pool):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 9, 15, 6, 11)]
    lengths = [12, 5, 20, 9, 14]
    chains = [("draft", "target"), ("ngram", "mid", "target"), ("target",), ("draft", "mid", "target"),
              ("ngram", "target")]
    eng = Engine(pool, max_num_seqs=4, max_model_len=64)
    seqs = {}
    pending = list(range(5))
    steps = 0
    while pending or eng.has_unfinished():
        # admit one new request every other step while capacity allows
        if pending and steps % 2 == 0:
            i = pending[0]
            try:
                seqs[i] = eng.add_request(prompts[i], SamplingParams(max_new_tokens=lengths[i], ignore_eos=True),
                                          chain=chains[i], k=1 + i % 4)
                pending.pop(0)
            except CapacityError:
                pass
        eng.step()
        steps += 1
        assert steps < 200
    for i, s in seqs.items():
        assert s.finish_reason == "length"
        assert s.output_ids == alone(pool, prompts[i], lengths[i]), i
    assert eng.state.live() == []


def test_abort_frees_state_and_capacity(pool):
    eng = Engine(pool, max_num_seqs=2, max_model_len=64)
    p = SamplingParams(max_new_tokens=30, ignore_eos=True)
    a = eng.add_request([5, 6, 7], p, chain=("draft", "target"))
    eng.add_request([8, 9], p, chain=("draft", "target"))
    with pytest.raises(CapacityError):
        eng.add_request([1, 2], p)
    eng.step()
    eng.abort(a.seq_id)
    assert a.finish_reason == "abort" and a.seq_id not in eng.state.live()
    c = eng.add_request([1, 2], p, chain=("draft", "target"))  # the freed slot is reused
    while eng.has_unfinished():
        eng.step()
    assert c.output_ids == alone(pool, [1, 2], 30)


def test_stop_token_at_the_last_allowed_position_is_a_stop(pool):
    """A stop token committed as the max_new_tokens-th token ends the row with "stop", not
    "length" (the stop wins: it is what the model said), in a cycle that committed several."""
    from specrouter.state.sequence import Sequence

    seq = Sequence(seq_id=0, tokens=[1, 2], prompt_len=2, params=SamplingParams(max_new_tokens=3),
                   stop_ids=frozenset({9}))
    assert seq.append([5, 6, 9, 7]) == 3
    assert seq.done and seq.finish_reason == "stop" and seq.output_ids == [5, 6, 9]
    # through the engine: stop at the token target greedy decoding emits last (its first occurrence)
    prompt = [1, 2]
    exp = alone(pool, prompt, 12)
    n = next(i + 1 for i in range(4, 12) if exp[i] not in exp[:i])
    for chain, k in [(("target",), 1), (("draft", "mid", "target"), 4), (("ngram", "target"), 3)]:
        p = SamplingParams(max_new_tokens=n, stop_token_ids=(exp[n - 1],), ignore_eos=True)
        s = Engine(pool).generate_ids([prompt], [p], chain=chain, k=k)[0]
        assert s.output_ids == exp[:n] and s.finish_reason == "stop", (chain, s.finish_reason)


def test_abort_in_the_middle_of_a_speculative_cycle(pool, monkeypatch):
    """A client goes away while the engine thread is inside a speculative cycle of three
    co-batched rows (the target is verifying): the abort takes effect after the cycle, the
    aborted row's state is freed, and the other two finish exactly as they would alone."""
    import asyncio
    import threading

    from specrouter.server.async_engine import AsyncEngine

    prompts = [[5, 6, 7, 5, 6], [8, 9, 10, 11], [12, 13, 12, 13, 12, 13]]
    n = 24
    eng = Engine(pool, max_num_seqs=4, max_model_len=96)
    target = pool.runners["target"]
    forward, seen, hit = target.forward, [], threading.Event()

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        ae = AsyncEngine(eng, seed=0)

        def verifying(batch):  # in the engine thread, between the draft and the target's verdict
            if len(batch.slots_list) == 3 and max(batch.num_tokens_list) > 1:
                seen.append(batch.num_tokens_list)
                if len(seen) == 3:
                    done = asyncio.run_coroutine_threadsafe(asyncio.sleep(0, ae.abort(handles[1])), loop)
                    done.result(timeout=30)
                    hit.set()
            return forward(batch)

        monkeypatch.setattr(target, "forward", verifying)
        ae.start()
        handles = [ae.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True),
                             chain=("draft", "mid", "target"), k=3) for p in prompts]
        out = {}
        try:
            for i in (0, 2):
                tokens, reason = [], None
                while reason is None:
                    ev = await asyncio.wait_for(handles[i].events.get(), 60)
                    tokens += ev.token_ids
                    reason = ev.finish_reason if ev.done else None
                out[i] = (tokens, reason)
        finally:
            ae.stop()
        out["aborted"] = handles[1].seq_id
        return out

    out = asyncio.run(run())
    assert hit.is_set(), seen  # the abort really came in mid-cycle, with all three rows batched
    for i in (0, 2):
        assert out[i] == (alone(pool, prompts[i], n), "length"), i
    assert eng.running == {} and eng.state.live() == []
    assert out["aborted"] is not None and out["aborted"] not in eng.state.live()


def test_sampling_tensors_are_built_once_per_row_set(pool, monkeypatch):
    """A request's SamplingParams are frozen: the engine builds its rows' SamplingTensors when
    the row set changes, not every step (four `torch.tensor` calls a step). Three requests, one
    sampled, joining and leaving: one build per distinct row set, and every row's output equals
    the same run with a fresh build each step. Negative control: without the reuse, one build per
    step (the count below, `builds == steps`)."""
    from specrouter.decoding.sampling import SamplingTensors

    built = []
    real = SamplingTensors.from_params

    def counting(params, device="cpu"):
        built.append(len(params))
        return real(params, device=device)

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 8, 6)]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=11),
              SamplingParams(max_new_tokens=7, ignore_eos=True)]

    def run(reuse: bool):
        eng = Engine(pool, max_num_seqs=3, max_model_len=64)
        if not reuse:  # the negative control's engine: a fresh build every step
            monkeypatch.setattr(eng, "_sampling_of", lambda rows: real([s.params for s in rows]))
        seqs, sets, steps = [eng.add_request(prompts[0], params[0], chain=("draft", "target"), k=3)], [], 0
        while eng.has_unfinished():
            if steps == 2:  # two requests join at the third step
                seqs += [eng.add_request(p, sp, chain=("target",)) for p, sp in zip(prompts[1:], params[1:])]
            ids = tuple(eng.running)
            if not sets or sets[-1] != ids:
                sets.append(ids)
            eng.step()
            steps += 1
        return [s.output_ids for s in seqs], len(sets), steps

    monkeypatch.setattr(SamplingTensors, "from_params", staticmethod(counting))
    outputs, row_sets, steps = run(reuse=True)
    assert len(built) == row_sets == 3 and steps >= 8, (built, row_sets, steps)  # one build per row set
    fresh, _, _ = run(reuse=False)
    assert fresh == outputs
    assert outputs[0] == alone(pool, prompts[0], 10) and outputs[2] == alone(pool, prompts[2], 7)
