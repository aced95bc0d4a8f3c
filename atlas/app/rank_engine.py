"""One rank of a model split over several devices: its part of the weights, its worker.

The driver (`parallel_engine.py`) starts `model_rank` in every rank process (`atlas.app.ranks`).
A rank builds its engine through the ordinary `build_engine` with a `RankPart` placement (its
device, its communicator, its shard of the weights, its own memory check and KV plan), so a
rank's startup is one device's startup; then it runs the driver's steps on that engine's worker:

    driver -> ranks:  RunStep(batch)       (no reply: the rank enqueues the step and goes on)
                      SampleStep(step_id, masks)  (no reply: a step that awaits its masks samples)
                      CollectStep(step_id) (reply: the step's StepResult, once its ids are in)

The driver sends step N+1 before it collects step N, so a rank enqueues N+1 before it waits for
N, as one device's engine does. Every rank samples the same ids from the same logits; each
replies with them and the driver checks they agree.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from atlas.app.backends import cuda_available, make_backend
from atlas.app.builder import StepLimits, build_engine
from atlas.app.ranks import RankContext
from atlas.app.settings import EngineSettings
from atlas.domain.batch import ScheduledBatch, StepResult
from atlas.domain.engine import PendingResult
from atlas.domain.models.cache_groups import CacheGroupSpec, KvShape, StateShape
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.model import Model
from atlas.domain.models.parallel_model import load_rank_model
from atlas.domain.parallel import RankPlacement
from atlas.ports.comm import CommBackend
from atlas.ports.gpu import GpuBackend
from atlas.ports.weights import WeightSource

log = logging.getLogger("atlas.rank")


class RankLoaded(msgspec.Struct):
    """A rank's report once loaded: its model's cache groups, how many pages of each its memory
    holds, and its part's bytes."""

    cache_groups: list[dict[str, Any]]  # `CacheGroupSpec`s as msgspec writes them (`cache_groups_of`)
    num_pages: list[int]
    weight_bytes: int
    device_name: str


def cache_groups_of(loaded: RankLoaded) -> tuple[CacheGroupSpec, ...]:
    """The cache groups a rank reported (msgspec decodes no union of dataclasses, so the shapes
    travel as plain mappings and are told apart by their fields here)."""
    groups = []
    for group in loaded.cache_groups:
        fields = group["shape"]
        shape = StateShape(**fields) if "conv_dim" in fields else KvShape(**fields)
        groups.append(CacheGroupSpec(shape, tuple(group["layers"])))
    return tuple(groups)


class RunStep(msgspec.Struct, tag=True):
    batch: ScheduledBatch


class SampleStep(msgspec.Struct, tag=True):
    """The masks of a step submitted with `awaits_masks` (`PendingResult.sample`): int32
    [num_rows, W] as bytes, or None when no row is constrained."""

    step_id: int
    num_rows: int = 0
    bitmask: bytes | None = None

    @classmethod
    def of(cls, step_id: int, bitmask: np.ndarray | None) -> SampleStep:
        if bitmask is None:
            return cls(step_id)
        return cls(step_id, bitmask.shape[0], np.ascontiguousarray(bitmask, dtype=np.int32).tobytes())

    def masks(self) -> np.ndarray | None:
        if self.bitmask is None:
            return None
        return np.frombuffer(self.bitmask, dtype=np.int32).reshape(self.num_rows, -1)


class CollectStep(msgspec.Struct, tag=True):
    step_id: int


class MeasureRank(msgspec.Struct, tag=True):
    """`atlas bench`: measure the rank's device and its share of decode steps of these sizes."""

    batch_sizes: list[int]


class RankMeasures(msgspec.Struct):
    device_name: str
    copy_bytes_per_s: float
    gemm_flops_per_s: float
    weight_bytes_per_step: int  # what one decode step of this rank reads
    kv_bytes_per_token: int  # per token of context, this rank's KV heads
    collective_s: list[float]  # per decode step of each batch size asked


RankMessage = RunStep | SampleStep | CollectStep | MeasureRank


class RankPart:
    """`ModelPlacement` of one rank: its device (the context's ordinal), its communicator, and
    its part of the weights (`load_rank_model`)."""

    def __init__(self, context: RankContext, settings: EngineSettings) -> None:
        self.context = context
        self.placement = RankPlacement(context.rank, context.world_size, settings.expert_parallel_size)
        self.comm: CommBackend | None = None
        self.release: Callable[[], None] = lambda: None

    def make_backend(self, settings: EngineSettings, config: ModelConfig) -> GpuBackend:
        context = self.context
        if on_mock(settings.device):
            from atlas.adapters.comm.mock import MockComm

            backend = make_backend("mock", config.model_type, settings.dtype)
            self.comm = MockComm.connect(context.comm_id, context.rank, context.world_size)
            return backend
        from atlas.adapters.cuda import CudaGpuBackend
        from atlas.adapters.cuda.custom_allreduce import FastAllReduceComm

        backend = CudaGpuBackend(device_ordinal=context.device_ordinal, model_hint=config.model_type,
                                 batch_invariant=settings.batch_invariant)
        self.comm = FastAllReduceComm.connect(backend.runtime, context.rank, context.world_size, context.comm_id)
        self.release = backend.close
        return backend

    def weight_bytes(self, checkpoint_bytes: int) -> int:
        """About 1/t of the weights (norms and routers, kept whole, are small)."""
        return checkpoint_bytes // self.context.world_size

    def load(self, config: ModelConfig, weights: WeightSource, backend: GpuBackend, max_positions: int,
             limits: StepLimits, progress: Callable[[int, int], None]) -> Model:
        if self.comm is None:
            raise RuntimeError("load before make_backend: the rank has no communicator")
        return load_rank_model(config, weights, backend, self.comm, self.placement, max_positions,
                               limits.max_tokens, limits.max_rows, progress)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
        self.release()


class ModelRank:
    """The `RankWorker` of a model rank (see the module docstring)."""

    def __init__(self, context: RankContext, settings: EngineSettings) -> None:
        self._part = RankPart(context, settings)
        try:
            engine = build_engine(settings, show_progress=False, placement=self._part)
        except BaseException:
            self._part.close()
            raise
        self._engine = engine
        self._executor = engine.core.executor
        self._pending: deque[tuple[int, PendingResult]] = deque()
        self._decode = msgspec.msgpack.Decoder(RankMessage).decode
        self._encode = msgspec.msgpack.Encoder().encode
        backend = engine.backend
        log.info("rank %d of %d loaded on %s", context.rank, context.world_size,
                 backend.capabilities.device_name if backend is not None else "?")

    def loaded(self) -> bytes:
        engine = self._engine
        device = engine.backend.capabilities.device_name if engine.backend is not None else ""
        groups = msgspec.to_builtins(list(engine.model.cache_groups)) if engine.model is not None else []
        return self._encode(RankLoaded(groups, list(engine.num_pages), engine.weight_bytes, device))

    def step(self, body: bytes) -> bytes:
        message = self._decode(body)
        if isinstance(message, RunStep):
            self._pending.append((message.batch.step_id, self._executor.submit(message.batch)))
            return b""
        if isinstance(message, SampleStep):
            step_id, pending = self._pending[-1]
            if step_id != message.step_id:
                raise RuntimeError(f"masks of step {message.step_id}, but step {step_id} is the last submitted")
            pending.sample(message.masks())
            return b""
        if isinstance(message, MeasureRank):
            return self._encode(self._measure(message.batch_sizes))
        step_id, pending = self._pending.popleft()
        if step_id != message.step_id:
            raise RuntimeError(f"collect of step {message.step_id}, but step {step_id} is the oldest in flight")
        return self._encode(pending.result())

    def close(self) -> None:
        self._part.close()

    def _measure(self, batch_sizes: list[int]) -> RankMeasures:
        from atlas.app.bench.ranks import measure_rank, rank_kv_bytes_per_token, rank_weight_bytes_per_step

        engine, part = self._engine, self._part
        if engine.backend is None or engine.model is None or part.comm is None:
            raise RuntimeError("the rank has no device model to measure")
        copy, gemm, collective_s = measure_rank(engine.backend, part.comm, engine.model, batch_sizes)
        itemsize = self._executor.kv_dtype.itemsize
        return RankMeasures(engine.backend.capabilities.device_name, copy, gemm,
                            rank_weight_bytes_per_step(engine.config, part.placement),
                            rank_kv_bytes_per_token(engine.config, part.placement, itemsize), collective_s)


def on_mock(device: str) -> bool:
    """Whether `--device` runs the ranks on the mock backend."""
    return device == "mock" or (device == "auto" and not cuda_available())


def model_rank(context: RankContext, settings: EngineSettings) -> ModelRank:
    """The rank factory the driver hands to `RankGroup` (pickled with `functools.partial`)."""
    return ModelRank(context, settings)


def decode_result(body: bytes) -> StepResult:
    return msgspec.msgpack.decode(body, type=StepResult)
