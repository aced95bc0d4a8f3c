"""`Generation.batches()` and the `OutputStream` under it: what a consumer gets when outputs
queue up, waits without output (heartbeat, interrupt), and what leaving early aborts.

The engine is an `OutputRouter` the test delivers to by hand, so each case controls exactly
which outputs are queued when the generation wakes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from atlas.adapters.http.generation import ChoiceUpdate, Generation
from atlas.adapters.http.in_flight import InFlight
from atlas.adapters.http.server_metrics import ServerMetrics
from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.app.bench.tiny_model import write_tiny_model
from atlas.app.engine_actor import OutputRouter, OutputStream
from atlas.domain.batch import SequenceOutput, TokenLogprobs
from atlas.domain.fan_out import SeedSource
from atlas.domain.requests import FinishReason, SamplingParams


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> HfTokenizer:
    return HfTokenizer.from_folder(write_tiny_model(Path(tmp_path_factory.mktemp("tiny")) / "model"))


class RoutedEngine:
    """An EngineClient whose outputs the test delivers; records aborts."""

    def __init__(self) -> None:
        self.router = OutputRouter()
        self.aborted: list[str] = []

    def submit(self, requests):
        return self.router.open([r.request_id for r in requests])

    def abort(self, request_ids):
        self.aborted.extend(self.router.close(request_ids))


def generation(engine, tokenizer, n: int = 1, heartbeat_s: float | None = None) -> Generation:
    metrics = ServerMetrics(lambda: None, lambda: True, lambda: 0)
    return Generation(engine, tokenizer, "req", [tokenizer.encode("Q:")], SamplingParams(n=n, max_tokens=50),
                      SeedSource(1, lambda: 0), metrics, InFlight(), heartbeat_s=heartbeat_s)


def output(seq_id: str, token_ids, finish: FinishReason | None = None, logprobs=()) -> SequenceOutput:
    return SequenceOutput(seq_id, tuple(token_ids), finish, 2, 1, logprobs)


def summary(updates: list[ChoiceUpdate]) -> list[tuple]:
    return [(u.index, u.text, u.num_tokens, len(u.logprobs), u.finish_reason) for u in updates]


@pytest.mark.anyio
async def test_queued_outputs_come_as_one_update_per_choice_in_order_of_first_output(tokenizer):
    engine = RoutedEngine()
    gen = generation(engine, tokenizer, n=3)
    first, second, third = (r.request_id for r in gen.requests)
    sea, blue = tokenizer.encode(" sea", False), tokenizer.encode(" blue", False)
    lp = TokenLogprobs(sea[0], -0.5, ())
    batches = gen.batches()
    pending = asyncio.ensure_future(batches.__anext__())
    await asyncio.sleep(0)  # the generation waits: nothing queued yet
    engine.router.deliver([output(second, sea, logprobs=(lp,)), output(first, blue),
                           output(second, blue, FinishReason.LENGTH, logprobs=(lp,)), output(third, ())])
    assert summary(await pending) == [(1, " sea blue", len(sea) + len(blue), 2, "length"),
                                      (0, " blue", len(blue), 0, None)]
    assert not gen.is_finished  # the third sent nothing yet: no empty update for it
    engine.router.deliver([output(first, (), FinishReason.STOP), output(third, sea, FinishReason.LENGTH)])
    assert summary(await batches.__anext__()) == [(0, "", 0, 0, "stop"), (2, " sea", len(sea), 0, "length")]
    assert gen.is_finished
    with pytest.raises(StopAsyncIteration):
        await batches.__anext__()
    assert engine.aborted == []


@pytest.mark.anyio
async def test_a_quiet_stream_gets_an_empty_batch_per_heartbeat_and_then_its_text(tokenizer):
    engine = RoutedEngine()
    gen = generation(engine, tokenizer, heartbeat_s=0.01)
    batches = gen.batches()
    assert await batches.__anext__() == []
    assert await batches.__anext__() == []
    sea = tokenizer.encode(" sea", False)
    engine.router.deliver([output(gen.requests[0].request_id, sea, FinishReason.LENGTH)])
    assert summary(await batches.__anext__()) == [(0, " sea", len(sea), 0, "length")]


@pytest.mark.anyio
async def test_an_interrupt_ends_a_waiting_generation_at_once_with_abort(tokenizer):
    engine = RoutedEngine()
    gen = generation(engine, tokenizer, n=2)
    batches = gen.batches()
    pending = asyncio.ensure_future(batches.__anext__())
    await asyncio.sleep(0)
    gen.interrupt()
    updates = await asyncio.wait_for(pending, 1)
    assert summary(updates) == [(0, "", 0, 0, "abort"), (1, "", 0, 0, "abort")]
    assert sorted(engine.aborted) == sorted(r.request_id for r in gen.requests)


@pytest.mark.anyio
async def test_leaving_the_batches_early_aborts_what_is_unfinished_and_closes_the_stream(tokenizer):
    engine = RoutedEngine()
    gen = generation(engine, tokenizer, n=2)
    first, second = (r.request_id for r in gen.requests)
    batches = gen.batches()
    pending = asyncio.ensure_future(batches.__anext__())
    await asyncio.sleep(0)  # submitted, waiting
    sea = tokenizer.encode(" sea", False)
    engine.router.deliver([output(first, sea, FinishReason.LENGTH)])
    assert summary(await pending) == [(0, " sea", len(sea), 0, "length")]
    await batches.aclose()  # the client went away
    assert engine.aborted == [second]
    assert len(engine.router) == 0


@pytest.mark.anyio
async def test_an_output_stream_wait_returns_on_an_item_the_end_a_wake_or_its_timeout():
    stream = OutputStream()
    assert await stream.wait(0.001) is False and stream.take() == []
    waiting = asyncio.ensure_future(stream.wait())
    await asyncio.sleep(0)
    stream.put("a")
    stream.put("b")
    assert await waiting is True
    assert await stream.wait() is True  # items queued: at once
    assert stream.take() == ["a", "b"] and stream.take() == []
    waiting = asyncio.ensure_future(stream.wait(10))
    await asyncio.sleep(0)
    stream.wake()
    assert await waiting is True and not stream.at_end
    stream.put("c")
    stream.end()
    assert not stream.at_end  # "c" is still queued
    assert stream.take() == ["c"] and stream.at_end and await stream.wait() is True
