"""Decode graphs a server defers past startup: eager until captured, then replayed."""

from __future__ import annotations

from fakes import TINY_LLAMA, DictWeights, random_llama_weights
from helpers.engines import make_cache, make_worker

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.domain.engine import EngineCore
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.families import load_model
from atlas.domain.requests import Request, SamplingParams
from atlas.domain.scheduler import Scheduler, SchedulerConfig
from atlas.domain.worker import WorkerConfig

NUM_BLOCKS, BLOCK_SIZE, MAX_LEN = 96, 4, 64
SIZES = (1, 2, 4, 8)


def build(up_to: int | None):
    config = ModelConfig.from_dict(TINY_LLAMA)
    backend = MockGpuBackend(emulate_graphs=True)
    model = load_model(config, DictWeights(random_llama_weights(TINY_LLAMA, 0)), backend, MAX_LEN)
    worker = make_worker(model, NUM_BLOCKS, BLOCK_SIZE, WorkerConfig(64, 8, MAX_LEN, graph_batch_sizes=SIZES))
    worker.capture_graphs(up_to)
    scheduler = Scheduler(SchedulerConfig(MAX_LEN, 8, 64, BLOCK_SIZE), make_cache(model, NUM_BLOCKS, BLOCK_SIZE, 8))
    return worker, EngineCore(scheduler, worker, MAX_LEN, config.vocab_size, frozenset())


def record_buckets(worker) -> list[int | None]:
    """The graph bucket of each step the worker runs from now on (None: eager)."""
    buckets: list[int | None] = []
    forward = worker._forward

    def recording(batch, bucket, packed, observer=None, chunks=None, before_launch=None):
        buckets.append(bucket)
        return forward(batch, bucket, packed, observer, chunks, before_launch)

    worker._forward = recording
    return buckets


def run(core: EngineCore, between_steps=lambda: []) -> dict[str, list[int]]:
    """Greedy tokens of six requests; `between_steps()` may return outputs of its own (a
    drain's), recorded in order with the steps'."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for index in range(6):
        core.add_request(Request(f"r{index}", (3 + index, 9, 13, 17, 21), params, seed=index))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished:
        for output in core.step() + between_steps():
            tokens.setdefault(output.seq_id, []).extend(output.new_token_ids)
    return tokens


def test_deferred_buckets_run_eagerly_until_captured_when_idle():
    worker, core = build(up_to=2)
    assert worker.num_deferred_graphs == 2  # 4 and 8
    buckets = record_buckets(worker)
    deferred_tokens = run(core)
    assert 8 not in buckets and 4 not in buckets  # six sequences decoded eagerly, not in bucket 8
    assert None in buckets
    while worker.capture_next_graph():  # the server's idle time
        pass
    assert worker.num_deferred_graphs == 0 and not worker.capture_next_graph()
    # then the variant of bucket 8 for decode rows over a shared prefix (none below 8 rows)
    assert set(worker._shared_prefix_graphs) == {8}
    buckets.clear()
    _, reference = build(up_to=None)
    assert run(core) == deferred_tokens  # the same core again, now from the graphs
    assert 8 in buckets
    assert run(reference) == deferred_tokens


def test_a_busy_engine_drains_and_captures_between_steps_without_changing_its_output():
    worker, core = build(up_to=2)
    _, reference = build(up_to=None)
    captured_while_busy = []

    def capture_now() -> list:
        if not (worker.num_deferred_graphs and core.has_unfinished):
            return []
        drained = core.drain()  # nothing in flight afterwards
        captured_while_busy.append(worker.capture_next_graph())
        return drained

    buckets = record_buckets(worker)
    tokens = run(core, between_steps=capture_now)
    assert captured_while_busy == [True, True] and worker.num_deferred_graphs == 0
    assert 8 in buckets  # the six sequences' decodes replayed bucket 8 once it was captured
    assert tokens == run(reference)


def test_every_bucket_is_captured_at_startup_without_a_limit():
    worker, _ = build(up_to=None)
    assert worker.num_deferred_graphs == 0 and not worker.capture_next_graph()


def test_the_engine_process_loop_does_idle_work_until_none_is_left_then_waits():
    import socket
    import threading

    import msgspec

    from atlas.app.engine_actor import Shutdown
    from atlas.app.engine_process import EngineLoop
    from atlas.app.engine_protocol import Commands, FrameBuffer, frame

    class IdleCore:
        has_unfinished = False

    pieces = [True, True, False]  # two pieces of work, then none
    calls = []

    def idle_work() -> bool:
        calls.append(len(calls))
        return pieces[len(calls) - 1]

    engine_side, api_side = socket.socketpair()
    loop = EngineLoop(IdleCore(), engine_side, FrameBuffer(), idle_work)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        for _ in range(200):
            if len(calls) == 3:
                break
            threading.Event().wait(0.01)
        assert calls == [0, 1, 2]  # done before any command came
        api_side.sendall(frame(msgspec.msgpack.encode(Commands([Shutdown()]))))
        thread.join(timeout=5)
        assert not thread.is_alive()
        assert len(calls) == 3  # no idle work once it said none is left
    finally:
        engine_side.close()
        api_side.close()


def test_an_engine_busy_from_its_start_does_its_idle_work_between_steps(monkeypatch):
    import socket
    import threading

    import msgspec

    from atlas.app import engine_process
    from atlas.app.engine_actor import Shutdown
    from atlas.app.engine_protocol import Commands, FrameBuffer, frame
    from atlas.domain.engine import EngineStats

    monkeypatch.setattr(engine_process, "_FORCE_IDLE_WORK_AFTER_S", 0.05)
    monkeypatch.setattr(engine_process, "_FORCED_IDLE_WORK_SPACING_S", 0.01)
    events = []

    class BusyCore:
        has_unfinished = True

        def step(self):
            events.append("step")
            threading.Event().wait(0.002)
            return []

        def drain(self):
            events.append("drain")
            return []

        def stats(self):
            return EngineStats(0, 0, 0, 0, 0, 0, 0, 0)

    def idle_work() -> bool:
        events.append("work")
        return events.count("work") < 2

    engine_side, api_side = socket.socketpair()
    loop = engine_process.EngineLoop(BusyCore(), engine_side, FrameBuffer(), idle_work)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        for _ in range(300):
            if events.count("work") == 2:
                break
            threading.Event().wait(0.01)
        api_side.sendall(frame(msgspec.msgpack.encode(Commands([Shutdown()]))))
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        engine_side.close()
        api_side.close()
    assert events.count("work") == 2  # then none is left: no more drains
    first = events.index("work")
    assert events[first - 1] == "drain" and events.index("step") < first  # steps ran first, then a drain
    assert events.count("drain") == 2
