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


def _wave(ae: AsyncEngine, n: int, prompt=(5, 6, 7)):
    return [ae.submit(list(prompt), PARAMS, chain=("target",), k=1) for _ in range(n)]


async def _returning_clients(ae: AsyncEngine, gap: float, linger: float):
    """A batch of 2 ends; its two clients send their next requests, the second `gap` s after
    the first, each held in `arriving` only while it is handled (no await between its body and
    its submit, as a handler that tokenizes on the loop)."""
    await _drain(_wave(ae, 2))
    return await _arrivals_apart(ae, gap, linger)


def test_the_clients_of_a_batch_that_just_ended_start_together_at_once(engine):
    """Both clients of the rows that ended are back: the batch starts together, and at once
    (not after the linger: 8 s here)."""
    t0 = time.perf_counter()
    rows = _run(engine, 8.0, lambda ae: _returning_clients(ae, 0.01, 8.0))
    assert rows == [2] * 6 + [2] * 6, rows
    assert time.perf_counter() - t0 < 4.0


def test_control_a_second_client_later_than_the_linger_is_not_awaited(engine):
    rows = _run(engine, 1.0, lambda ae: _returning_clients(ae, 0.3, 0.02))
    assert rows[6] == 1 and rows[-1] == 1, rows  # the second came too late: its row runs alone


async def _lone_returner(ae: AsyncEngine):
    """c=1: a request ends, its client sends the next at once: one row expected, one came."""
    await _drain(_wave(ae, 1))
    t0 = time.perf_counter()
    h = _wave(ae, 1)
    first = await h[0].events.get()
    ae.lone_ttft = first.committed - t0
    return h


def test_a_lone_client_is_not_held(engine):
    """The expectation met (one row ended, one request came), the engine starts at once: no
    linger, no wait for arrivals that are not coming."""
    ae_box = {}

    async def scenario(ae):
        ae_box["ae"] = ae
        ae.admission_linger = 5.0  # would show if it applied
        return await _lone_returner(ae)

    rows = _run(engine, 30.0, scenario)
    assert rows == [1] * 12, rows
    assert ae_box["ae"].lone_ttft < 1.0


async def _arrivals_apart(ae: AsyncEngine, gap: float, linger: float):
    """Two requests from an idle engine (no batch just ended), `gap` s apart, each held in
    `arriving` only while it is handled (no await between body and submit)."""
    ae.admission_linger = linger
    with ae.arriving():
        first = _wave(ae, 1)
    await asyncio.sleep(gap)
    with ae.arriving():
        second = _wave(ae, 1)
    return first + second


def test_an_idle_engine_lingers_for_a_request_just_behind(engine):
    rows = _run(engine, 1.0, lambda ae: _arrivals_apart(ae, 0.02, 0.2))
    assert rows == [2] * 6, rows


def test_control_without_the_linger_the_first_starts_alone(engine):
    rows = _run(engine, 1.0, lambda ae: _arrivals_apart(ae, 0.02, 0.0))
    assert rows[0] == 1 and rows[-1] == 1, rows
