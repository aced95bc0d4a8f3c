"""The output router and the in-process engine actor on the tiny random model."""

from __future__ import annotations

import threading

import anyio
import pytest
from fakes import TINY_LLAMA, DictWeights, random_llama_weights
from helpers.engines import make_cache, make_worker

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.app.engine_actor import EngineActor, OutputRouter
from atlas.domain.engine_events import EngineFailure
from atlas.domain.batch import SequenceOutput
from atlas.domain.engine import EngineCore
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.families import load_model
from atlas.domain.requests import FinishReason, Request, SamplingParams
from atlas.domain.scheduler import Scheduler, SchedulerConfig
from atlas.domain.worker import WorkerConfig

NUM_BLOCKS = 64
BLOCK_SIZE = 4
MAX_LEN = 96


@pytest.fixture
def anyio_backend():
    return "asyncio"


def build_core() -> EngineCore:
    config = ModelConfig.from_dict(TINY_LLAMA)
    backend = MockGpuBackend()
    model = load_model(config, DictWeights(random_llama_weights(TINY_LLAMA, 0)), backend, MAX_LEN)
    worker = make_worker(model, NUM_BLOCKS, BLOCK_SIZE, WorkerConfig(128, 16, MAX_LEN))
    scheduler = Scheduler(SchedulerConfig(MAX_LEN, 16, 128, BLOCK_SIZE), make_cache(model, NUM_BLOCKS, BLOCK_SIZE, 16))
    return EngineCore(scheduler, worker, MAX_LEN, config.vocab_size, frozenset({96}))


def request(request_id: str, max_tokens: int = 6, prompt=(5, 9, 13, 17), **sampling) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return Request(request_id, tuple(prompt), params, seed=1)


def output(seq_id: str, token: int, finish: FinishReason | None = None) -> SequenceOutput:
    return SequenceOutput(seq_id, (token,), finish, 4, 1)


async def drain(stream) -> list:
    return [item async for item in stream]


@pytest.mark.anyio
async def test_the_router_closes_a_shared_stream_when_its_last_sequence_ends():
    router = OutputRouter()
    stream = router.open(["a-0", "a-1"])
    other = router.open(["b"])
    orphans = router.deliver([output("a-0", 3), output("b", 4, FinishReason.STOP), output("a-1", 5),
                              output("a-0", 6, FinishReason.LENGTH), output("ghost", 1)])
    assert orphans == [] and "a-1" in router and "a-0" not in router
    router.deliver([output("a-1", 7, FinishReason.STOP)])
    assert [(o.seq_id, o.new_token_ids) for o in await drain(stream)] == [
        ("a-0", (3,)), ("a-1", (5,)), ("a-0", (6,)), ("a-1", (7,))]
    assert [o.seq_id for o in await drain(other)] == ["b"]
    assert len(router) == 0
    with pytest.raises(ValueError):
        router.open(["c", "c"])


@pytest.mark.anyio
async def test_a_waiting_reader_wakes_for_each_output_and_for_the_end():
    router = OutputRouter()
    stream = router.open(["a"])
    with pytest.raises(anyio.WouldBlock):
        stream.receive_nowait()
    received = []

    async def read() -> None:
        received.append(await stream.receive())
        received.extend(await drain(stream))

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        await anyio.sleep(0.01)  # the reader is waiting now
        router.deliver([output("a", 1)])
        await anyio.sleep(0.01)
        assert [o.new_token_ids for o in received] == [(1,)]
        router.deliver([output("a", 2, FinishReason.STOP)])
    assert [o.new_token_ids for o in received] == [(1,), (2,)]
    with pytest.raises(anyio.EndOfStream):
        stream.receive_nowait()


@pytest.mark.anyio
async def test_the_router_fails_a_request_once_and_reports_siblings_and_orphans():
    router = OutputRouter()
    stream = router.open(["a-0", "a-1", "a-2"])
    router.close(["a-2"])
    siblings = router.fail("a-0", EngineFailure("bad", True, "prompt"))
    assert siblings == ["a-1"] and len(router) == 0
    assert await drain(stream) == [EngineFailure("bad", True, "prompt")]
    closed_early = router.open(["x", "y"])
    closed_early.close()  # a consumer that went away without aborting
    assert sorted(router.deliver([output("x", 1)])) == ["x", "y"] and len(router) == 0


@pytest.mark.anyio
async def test_an_output_with_an_error_fails_its_request_and_names_the_siblings_to_abort():
    router = OutputRouter()
    stream = router.open(["a-0", "a-1"])
    failed = SequenceOutput("a-0", (), FinishReason.ABORT, 4, 1, error="a forbidden token")
    assert router.deliver([output("a-1", 3), failed]) == ["a-1"] and len(router) == 0
    items = await drain(stream)
    assert items[0].seq_id == "a-1" and items[1] == EngineFailure("a forbidden token")


@pytest.mark.anyio
async def test_the_actor_runs_n_sequences_and_frees_every_block():
    core = build_core()
    actor = EngineActor(core)
    async with anyio.create_task_group() as group:
        group.start_soon(actor.run)
        stream = actor.submit([request("r-0"), request("r-1", max_tokens=3)])
        items = await drain(stream)
        actor.shutdown()
    tokens: dict[str, list[int]] = {}
    for item in items:
        tokens.setdefault(item.seq_id, []).extend(item.new_token_ids)
    assert {seq: len(ids) for seq, ids in tokens.items()} == {"r-0": 6, "r-1": 3}
    assert tokens["r-0"][:3] == tokens["r-1"]  # same prompt, greedy
    stats = actor.stats()
    assert stats.num_blocks_free == NUM_BLOCKS and stats.num_running == 0 and stats.num_generated_tokens == 9


@pytest.mark.anyio
async def test_an_aborted_request_frees_its_blocks_without_another_step():
    core = build_core()
    actor = EngineActor(core)
    async with anyio.create_task_group() as group:
        group.start_soon(actor.run)
        stream = actor.submit([request("long", max_tokens=80)])
        first = await stream.receive()
        assert first.new_token_ids
        actor.abort(["long"])
        actor.abort(["long"])  # twice is harmless
        with anyio.fail_after(10):
            while actor.stats().num_blocks_free != NUM_BLOCKS:
                await anyio.sleep(0.01)
        assert actor.stats().num_running == 0
        actor.shutdown()


@pytest.mark.anyio
async def test_an_invalid_request_fails_with_a_user_error_naming_the_field():
    actor = EngineActor(build_core())
    async with anyio.create_task_group() as group:
        group.start_soon(actor.run)
        stream = actor.submit([request("bad-0", prompt=(5, 500)), request("bad-1", prompt=(5, 500))])
        items = await drain(stream)
        actor.shutdown()
    assert len(items) == 1 and isinstance(items[0], EngineFailure)
    assert items[0].is_user_error and items[0].field == "prompt" and "500" in items[0].message
    assert actor.stats().num_blocks_free == NUM_BLOCKS


@pytest.mark.anyio
async def test_health_reports_a_step_that_does_not_finish():
    now = [100.0]
    release = threading.Event()

    class SlowCore:
        has_unfinished = False

        def stats(self):
            return build_core().stats()

        def add_request(self, request):
            self.has_unfinished = True

        def step(self):
            release.wait(10)
            self.has_unfinished = False
            return []

    actor = EngineActor(SlowCore(), stall_timeout_s=30.0, clock=lambda: now[0])
    assert not actor.health().ready
    async with anyio.create_task_group() as group:
        group.start_soon(actor.run)
        await anyio.sleep(0.01)
        assert actor.health().is_healthy
        actor.submit([request("stuck")])
        await anyio.sleep(0.05)
        now[0] += 31.0
        health = actor.health()
        assert health.ready and not health.progressing and "31" in health.detail
        release.set()
        with anyio.fail_after(5):
            while not actor.health().progressing:
                await anyio.sleep(0.01)
        actor.shutdown()
