"""A model split over several devices: the engine core here, one rank process per device.

    engine core (this process)                          ranks 0..t-1 (rank_engine.ModelRank)
      parallel_refusal: sizes that divide, or the flag and the sizes that would
      RankGroup.start  -------------------------------->  build_engine with RankPart: device,
                       <-- RankLoaded(groups, pages) --  communicator, shard, memory plan, graphs
      scheduler over the fewest blocks any rank holds
      EngineCore.step: submit(N+1) -- RunStep ---------->  worker.submit (enqueued)
                       result(N)   -- CollectStep ----->  worker's PendingStep.result()
                                  <-- StepResult ------    (every rank's; they must agree)

The scheduler, the prefix cache and the stop rules run once, here; the ranks only execute.
A rank that fails or dies fails the group at once (`RankGroup`), and the engine reports it:
`LoadedEngine.watch` calls back with the rank named, and a step in flight raises
`RankFailure`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Callable

import msgspec
import numpy as np

from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.app.builder import LoadedEngine, engine_grammars, make_core, read_model_config
from atlas.app.model_store import resolve_model
from atlas.app.rank_engine import (
    CollectStep,
    MeasureRank,
    RankLoaded,
    RankMeasures,
    RunStep,
    SampleStep,
    cache_groups_of,
    decode_result,
    model_rank,
    on_mock,
)
from atlas.app.ranks import RankFailure, RankGroup
from atlas.app.settings import EngineSettings, SettingsError
from atlas.domain.batch import ScheduledBatch, StepResult
from atlas.domain.memory_plan import GIB
from atlas.domain.models.families import check_supported
from atlas.domain.models.quantization_config import check_quantization
from atlas.domain.parallel import ShardedSizes, parallel_refusal

log = logging.getLogger("atlas")

MAX_MOCK_RANKS = 8


class RankExecutor:
    """The engine core's `StepExecutor` over a rank group (see the module docstring). Steps are
    collected in the order they were submitted: asking for a later one collects the earlier."""

    def __init__(self, group: RankGroup) -> None:
        self._group = group
        self._encode = msgspec.msgpack.Encoder().encode
        self._in_flight: deque[PendingRankStep] = deque()

    def submit(self, batch: ScheduledBatch, before_launch: Callable[[], None] | None = None) -> PendingRankStep:
        if before_launch is not None:  # the ranks build the step's inputs themselves, after this
            before_launch()
        self._group.send(self._encode(RunStep(batch)))
        pending = PendingRankStep(self, batch.step_id)
        self._in_flight.append(pending)
        return pending

    def sample(self, step_id: int, bitmask: np.ndarray | None) -> None:
        """Hand every rank the masks of step `step_id`, the last submitted (`awaits_masks`)."""
        self._group.send(self._encode(SampleStep.of(step_id, bitmask)))

    def collect_until(self, pending: PendingRankStep) -> None:
        """Collect every step in flight up to `pending`. RankFailure when a rank failed or the
        ranks' results differ."""
        while pending.is_pending:
            oldest = self._in_flight.popleft()
            oldest.resolve(self._collect(oldest.step_id))

    def measure(self, batch_sizes: list[int]) -> list[RankMeasures]:
        """Every rank's device ceilings and its share of a decode step (`atlas bench`)."""
        return [msgspec.msgpack.decode(reply, type=RankMeasures)
                for reply in self._group.step(self._encode(MeasureRank(batch_sizes)))]

    def _collect(self, step_id: int) -> StepResult:
        replies = self._group.step(self._encode(CollectStep(step_id)))
        for rank, reply in enumerate(replies[1:], start=1):
            if reply != replies[0]:
                ours, theirs = decode_result(replies[0]).token_ids, decode_result(reply).token_ids
                raise RankFailure(rank, f"rank {rank} sampled other tokens than rank 0 at step {step_id}: "
                                        f"{theirs} against {ours}")
        return decode_result(replies[0])


class PendingRankStep:
    def __init__(self, executor: RankExecutor, step_id: int) -> None:
        self._executor = executor
        self.step_id = step_id
        self._result: StepResult | None = None

    @property
    def is_pending(self) -> bool:
        return self._result is None

    def sample(self, bitmask: np.ndarray | None) -> None:
        self._executor.sample(self.step_id, bitmask)

    def resolve(self, result: StepResult) -> None:
        self._result = result

    def result(self) -> StepResult:
        self._executor.collect_until(self)
        return self._result


def check_parallel_sizes(settings: EngineSettings, sizes: ShardedSizes, num_devices: int) -> None:
    """SettingsError naming the flag when the model does not split as asked, or when there are
    fewer devices than ranks."""
    ranks, experts = settings.tensor_parallel_size, settings.expert_parallel_size
    refusal = parallel_refusal(sizes, ranks, experts, max_ranks=max(num_devices, 1))
    if refusal is not None:
        flag = "--enable-expert-parallel with " if settings.enable_expert_parallel and sizes.num_experts else ""
        raise SettingsError(f"{flag}--tensor-parallel-size {ranks}: {refusal}")
    if ranks > num_devices:
        raise SettingsError(
            f"--tensor-parallel-size {ranks} needs {ranks} GPUs; this host has {num_devices}"
        )


def build_parallel_engine(settings: EngineSettings, show_progress: bool = True) -> LoadedEngine:
    """Check the sizes, start the ranks (each loads its part and plans its memory), and wire the
    engine core over them. User mistakes raise ValueError naming the flag; a rank's own (too
    little memory, a bad checkpoint) is raised with its message."""
    model_dir = resolve_model(settings.model)
    config = read_model_config(model_dir)
    check_supported(config)
    check_quantization(config.raw, loadable=())
    mock = on_mock(settings.device)
    if settings.dtype == "f32" and not mock:
        raise SettingsError("--dtype f32 runs only on the mock backend; the CUDA kernels compute in bf16")
    check_parallel_sizes(settings, ShardedSizes.of(config), MAX_MOCK_RANKS if mock else _gpu_count())
    tokenizer = HfTokenizer.from_folder(model_dir)
    max_model_len = settings.max_seq_len or config.max_position_embeddings
    world = settings.tensor_parallel_size
    group = RankGroup(world, functools.partial(model_rank, settings=settings), _comm_id(mock))
    log.info("starting %d ranks for %s (tensor-parallel %d, expert-parallel %d)", world, model_dir, world,
             settings.expert_parallel_size)
    owner = _GroupOwner(group)
    try:
        loaded = [msgspec.msgpack.decode(body, type=RankLoaded) for body in owner.start()]
    except RankFailure as failure:
        if failure.is_user_error:
            raise ValueError(str(failure)) from None
        raise
    groups = cache_groups_of(loaded[0])
    num_pages = [min(rank.num_pages[index] for rank in loaded) for index in range(len(groups))]
    log.info("%d ranks loaded (%.2f GiB of weights each on %s); cache pages per group and rank: %s (blocks of %d tokens)",
             world, loaded[0].weight_bytes / GIB, loaded[0].device_name, num_pages, settings.block_size)
    executor = RankExecutor(group)
    core = make_core(settings, groups, num_pages, executor, max_model_len, config.vocab_size, tokenizer,
                     engine_grammars(tokenizer, model_dir, config.vocab_size))
    return LoadedEngine(
        core=core,
        tokenizer=tokenizer,
        config=config,
        model_dir=model_dir,
        model_name=settings.model,
        backend=None,
        model=None,
        max_model_len=max_model_len,
        settings=settings,
        on_close=owner.close,
        ranks=executor,
        on_watch=lambda callback: group.watch(lambda failure: callback(str(failure))),
    )


class _GroupOwner:
    """Starts the group from a thread of its own that lives until `close`: the ranks die with
    the thread that started them (Linux's parent-death signal), and the caller's may not last
    (an anyio worker thread that loads the model in the API process)."""

    def __init__(self, group: RankGroup) -> None:
        self._group = group
        self._started = threading.Event()
        self._stop = threading.Event()
        self._loaded: list[bytes] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rank-group", daemon=True)

    def start(self) -> list[bytes]:
        """Every rank's `loaded()` bytes; the group's failure (its ranks stopped) otherwise."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self._loaded

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            self._loaded = self._group.start()
        except BaseException as error:  # noqa: BLE001 - handed to the caller of start
            self._error = error
            self._group.close()
            return
        finally:
            self._started.set()
        self._stop.wait()
        self._group.close()


def _comm_id(mock: bool) -> bytes:
    if mock:
        from atlas.adapters.comm.mock import new_mock_comm_id

        return new_mock_comm_id()
    from atlas.adapters.nccl.comm import nccl_unique_id

    return nccl_unique_id()


def _gpu_count() -> int:
    from atlas.adapters.cuda import device_count

    return device_count()
