"""Admission over HTTP (server/async_engine.py): an idle engine about to start a batch waits, at
most `admission_wait`, for requests still arriving (their handlers hold `arriving()` from the body
to the submission), so requests sent together start in one step, as the in-process engine's
batch does; the control (no wait) starts the first request alone."""

from __future__ import annotations

import asyncio
import contextlib
import time

import openai
import pytest

from specrouter.config import SamplingParams, ServerConfig
from specrouter.engine.engine import Engine
from specrouter.models.pool import Pool
from specrouter.server import create_app
from specrouter.server.async_engine import AsyncEngine
from specrouter.server.live import LiveServer


@pytest.fixture
def engine(tiny_pool_dirs):
    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float64")
    eng = Engine(pool, max_num_seqs=4, max_model_len=64)
    eng.rows_per_step = []  # len(running) at every step
    step = eng.step

    def logged_step():
        eng.rows_per_step.append(len(eng.running))
        return step()

    eng.step = logged_step
    return eng


PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


async def _drain(handles) -> None:
    for h in handles:
        while not (await h.events.get()).done:
            pass


def _run(engine, wait: float, scenario) -> list[int]:
    async def main():
        ae = AsyncEngine(engine, seed=0, admission_wait=wait)
        ae.start()
        try:
            await _drain(await scenario(ae))
        finally:
            await asyncio.to_thread(ae.stop)
    asyncio.run(main())
    return engine.rows_per_step


async def _three_together(ae: AsyncEngine):
    """Three requests on their way; the first is submitted 50 ms before the other two."""
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(ae.arriving())
        first = ae.submit([5, 6, 7], PARAMS, chain=("target",), k=1)
        await asyncio.sleep(0.05)  # an engine that does not wait has started the first alone
        rest = [ae.submit([5, 6, 7, 8], PARAMS, chain=("target",), k=1) for _ in range(2)]
    return [first, *rest]


def test_an_idle_engine_waits_for_requests_on_their_way(engine):
    rows = _run(engine, 30.0, _three_together)
    assert rows == [3] * 6, rows  # one batch from the first step to the last


def test_control_without_the_wait_the_first_request_starts_alone(engine):
    rows = _run(engine, 0.0, _three_together)
    assert rows[0] == 1 and rows[-1] == 2, rows  # and its row ends a step ahead of the others


def test_the_wait_is_bounded_and_ends_when_an_arrival_fails(engine):
    async def slow(ae: AsyncEngine):  # one arrival takes far longer than the wait
        with ae.arriving():
            with ae.arriving():
                h = ae.submit([5, 6, 7], PARAMS, chain=("target",), k=1)
            await asyncio.sleep(1.0)
        return [h]

    async def failed(ae: AsyncEngine):  # one arrival fails (never submitted): nobody waits for it
        with ae.arriving():
            with ae.arriving():
                h = ae.submit([5, 6, 7], PARAMS, chain=("target",), k=1)
            t0 = time.perf_counter()
        await _drain([h])
        assert time.perf_counter() - t0 < 10.0  # not the 30 s wait
        return []

    assert _run(engine, 0.05, slow)[0] == 1
    engine.rows_per_step.clear()
    assert _run(engine, 30.0, failed)[0] == 1


def test_handlers_hold_arriving_only_until_their_rows_are_submitted(tiny_pool_dirs):
    """Over HTTP: a request refused before submission and a served one (streamed and not) leave
    no arrival behind, and a streamed response is not an arrival while it streams."""
    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float64")
    app = create_app(pool, ServerConfig(max_num_seqs=2, max_model_len=64, adaptive=False))
    loop_engine = app.state.server.loop_engine
    with LiveServer(app) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="target", prompt=[5, 6], max_tokens=4, temperature=-1.0)
        client.completions.create(model="target", prompt=[5, 6, 7], max_tokens=4, temperature=0)
        stream = client.completions.create(model="target", prompt=[5, 6, 7], max_tokens=8, temperature=0,
                                           stream=True)
        next(iter(stream))
        assert loop_engine._arriving == 0
        for _ in stream:
            pass
        assert loop_engine._arriving == 0
