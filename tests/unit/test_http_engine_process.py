"""The engine core in its own process: framing, the request/abort protocol, load and crash
failures. Each test spawns a real engine process on the tiny random model."""

from __future__ import annotations

import os
import signal

import anyio
import msgspec
import pytest

from atlas.app.bench.tiny_model import TinyModelShape, write_tiny_model
from atlas.domain.engine_events import EngineFailure
from atlas.app.engine_process import EngineProcess, EngineStopped
from atlas.app.engine_protocol import HEADER, MAX_FRAME_BYTES, FrameBuffer, frame
from atlas.app.settings import EngineSettings
from atlas.domain.requests import Request, SamplingParams


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> EngineSettings:
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", shape=TinyModelShape(num_layers=1))
    return EngineSettings(str(folder), device="mock", max_seq_len=128, kv_cache_gb=0.01, block_size=8)


def request(request_id: str, max_tokens: int, seed: int = 0) -> Request:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, (10, 20, 30, 40, 50), params, seed=seed)


def test_frames_split_anywhere_reassemble():
    bodies = [b"", b"a", b"hello" * 1000, msgspec.msgpack.encode({"x": [1, 2, 3]})]
    stream = b"".join(frame(body) for body in bodies)
    for piece_size in (1, 3, 7, 4096, len(stream)):
        buffer = FrameBuffer()
        out = []
        for start in range(0, len(stream), piece_size):
            out.extend(buffer.feed(stream[start:start + piece_size]))
        assert out == bodies
    with pytest.raises(ValueError):
        FrameBuffer().feed(HEADER.pack(MAX_FRAME_BYTES + 1))


@pytest.mark.anyio
async def test_requests_run_abort_and_shut_down_across_the_process(settings):
    engine = EngineProcess(settings)
    ready = await engine.start()
    assert ready.max_model_len == 128 and ready.vocab_size > 256
    total_blocks = ready.stats.num_blocks_total
    assert engine.health().is_healthy
    async with anyio.create_task_group() as group:
        group.start_soon(engine.run)
        finished = engine.submit([request("a-0", 12, seed=1), request("a-1", 12, seed=2)])
        tokens: dict[str, list[int]] = {"a-0": [], "a-1": []}
        async for item in finished:
            tokens[item.seq_id].extend(item.new_token_ids)
        assert [len(t) for t in tokens.values()] == [12, 12] and tokens["a-0"] != tokens["a-1"]

        long = engine.submit([request("long", 100)])
        first = await long.receive()
        assert first.seq_id == "long"
        engine.abort(["long"])
        with anyio.fail_after(20):
            while engine.stats().num_blocks_free != total_blocks or engine.stats().num_running:
                await anyio.sleep(0.01)
        assert engine.stats().num_generated_tokens < 24 + 100
        engine.shutdown()
    assert engine._process.returncode == 0


@pytest.mark.anyio
async def test_an_invalid_request_fails_with_the_engine_message(settings):
    engine = EngineProcess(settings)
    await engine.start()
    async with anyio.create_task_group() as group:
        group.start_soon(engine.run)
        params = SamplingParams(max_tokens=4, stop_token_ids=(10**6,))
        items = [item async for item in engine.submit([Request("bad", (1, 2), params, seed=0)])]
        engine.shutdown()
    assert len(items) == 1 and isinstance(items[0], EngineFailure)
    assert items[0].is_user_error and items[0].field == "stop_token_ids"


@pytest.mark.anyio
async def test_a_load_failure_raises_the_engine_message(settings, tmp_path):
    missing = EngineSettings(str(tmp_path / "nothing"), device="mock")
    engine = EngineProcess(missing)
    with pytest.raises(ValueError, match="nothing"):
        await engine.start()
    assert engine._process.returncode == 2


@pytest.mark.anyio
async def test_a_dead_engine_process_fails_open_requests_and_health(settings):
    engine = EngineProcess(settings)
    await engine.start()
    stopped: list[EngineStopped] = []

    async def run() -> None:
        try:
            await engine.run()
        except EngineStopped as error:
            stopped.append(error)

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        stream = engine.submit([request("doomed", 100)])
        await stream.receive()
        os.kill(engine._process.pid, signal.SIGKILL)
        items = [item async for item in stream]
        assert isinstance(items[-1], EngineFailure) and not items[-1].is_user_error
    assert len(stopped) == 1
    health = engine.health()
    assert not health.ready and "exited" in health.detail
    late = [item async for item in engine.submit([request("late", 3)])]
    assert isinstance(late[0], EngineFailure)


@pytest.mark.anyio
async def test_health_reports_an_engine_that_stops_making_progress(settings):
    now = [0.0]
    engine = EngineProcess(settings, stall_timeout_s=30.0, clock=lambda: now[0])
    await engine.start()
    async with anyio.create_task_group() as group:
        group.start_soon(engine.run)
        now[0] = 1000.0  # a long idle spell is not a stall
        assert engine.health().is_healthy
        stream = engine.submit([request("slow", 100)])
        await stream.receive()
        os.kill(engine._process.pid, signal.SIGSTOP)
        try:
            now[0] += 31.0
            health = engine.health()
            assert health.ready and not health.progressing and "31" in health.detail
        finally:
            os.kill(engine._process.pid, signal.SIGCONT)
        async for _ in stream:
            pass
        assert engine.health().is_healthy
        engine.shutdown()


@pytest.mark.anyio
async def test_an_engine_spawned_early_is_the_one_started_and_an_untaken_one_exits(settings):
    from atlas.app import engine_spawn

    engine_spawn.spawn_early(preload_cuda=True)  # no GPU here: the preload finds none and goes on
    early = engine_spawn._early[0].process
    engine = EngineProcess(settings)
    with anyio.fail_after(60):
        await engine.start()
        assert engine._process is early and engine_spawn.take_early() is None
        async with anyio.create_task_group() as group:
            group.start_soon(engine.run)
            tokens = [t for item in [item async for item in engine.submit([request("e-0", 4)])]
                      for t in item.new_token_ids]
            assert len(tokens) == 4
            engine.shutdown()
    assert early.returncode == 0

    engine_spawn.spawn_early(preload_cuda=False)
    untaken = engine_spawn._early[0].process
    engine_spawn.spawn_early(preload_cuda=False)  # `atlas serve` again after the entry's spawn: kept
    assert engine_spawn._early[0].process is untaken
    engine_spawn.spawn_early(preload_cuda=True)  # the entry guessed the device wrong: replaced
    replaced, untaken = untaken, engine_spawn._early[0].process
    assert replaced.returncode == 0 and untaken is not replaced
    engine_spawn.discard_early()  # as `atlas serve` does when its flags fail after the spawn
    assert untaken.returncode == 0 and engine_spawn.take_early() is None


def test_the_cuda_preload_imports_its_libraries_and_a_missing_one_ends_it_quietly(monkeypatch):
    import sys
    import threading

    from atlas.app import engine_spawn

    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    sys.modules.pop("colorsys", None)
    engine_spawn.start_cuda_preload(("colorsys", "atlas_no_such_library", "wave")).join(timeout=30)
    assert "colorsys" in sys.modules and raised == []  # imported before the missing one stopped it
    assert not any(name.startswith("atlas") for name in engine_spawn.CUDA_LIBRARIES)
