"""The composition root: settings in, a running engine out.

Resolves the model, reads its config, checks memory before committing to anything, loads the
weights onto the chosen backend, sizes the KV cache, and wires scheduler, worker and engine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.adapters.weights.safetensors import SafetensorsWeights
from atlas.app.backends import make_backend
from atlas.app.chat_features import LazyGrammarCompiler, process_grammars
from atlas.app.draft_heads import head_proposer, load_head, open_head
from atlas.app.draft_model import DraftCheckpoint, load_draft_model, open_draft_model
from atlas.app.model_store import resolve_model
from atlas.app.progress import Progress
from atlas.app.settings import EngineSettings, SettingsError
from atlas.domain.cache.manager import CacheManager
from atlas.domain.device_caches import allocate_caches
from atlas.domain.engine import EngineCore, StepExecutor
from atlas.domain.grammar_service import GrammarWorker
from atlas.domain.memory_plan import GIB, CacheDemand, CachePlan, check_weights_fit, plan_cache
from atlas.domain.models.cache_groups import CacheGroupKind, CacheGroupSpec
from atlas.domain.models.config import ModelConfig, ModelConfigError
from atlas.domain.models.families import check_supported, fp8_layouts, kv_cache_scales, load_model, model_kinds
from atlas.domain.models.model import Model
from atlas.domain.models.quantization_config import check_quantization, with_quantization
from atlas.domain.models.quantization_weights import QuantizedOnLoad, checkpoint_bytes
from atlas.domain.request_constraints import GrammarCache
from atlas.domain.scheduler import Scheduler, SchedulerConfig
from atlas.domain.scheduling_policy import POLICIES
from atlas.domain.speculative.config import SpeculativeConfig, SpeculativeMethod
from atlas.domain.speculative.draft_head import DraftHeadProposer
from atlas.domain.speculative.draft_model import DraftModelProposer
from atlas.domain.speculative.policy import speculation_policy
from atlas.domain.worker import Worker, WorkerConfig
from atlas.ports.gpu import DType, GpuBackend, Kind
from atlas.ports.startup import PhaseTimer
from atlas.ports.tokenizer import Tokenizer
from atlas.ports.weights import WeightSource

if TYPE_CHECKING:
    from atlas.app.parallel_engine import RankExecutor

log = logging.getLogger("atlas")

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# a server captures these at startup (an interactive user's batches) and the rest when idle
STARTUP_GRAPH_BATCH = 8
# Steps with prompt tokens up to this many replay their layers' pieces where the backend has
# them (`WorkerConfig.piece_max_tokens`): on an H100 the 8B's eager step costs the host ~6.5 ms
# of launches at any size, as long as the device's own work up to a few hundred tokens
# (benchmarks/eager_host.py); past that the device dominates and padding would only add work.
PIECE_MAX_TOKENS = 512
MOCK_KV_CACHE_GB = 2.0
_KV_DTYPES = {"bf16": DType.BF16, "f16": DType.F16, "f32": DType.F32, "fp8": DType.FP8_E4M3, "fp8_e4m3": DType.FP8_E4M3}


@dataclass
class LoadedEngine:
    """Everything a front end needs: the engine core, the tokenizer and the model's identity.

    A model on rank processes (`parallel_engine.py`) has no backend or model in this process;
    `close` stops its ranks, and `watch` reports their failure (a rank that died while idle)."""

    core: EngineCore
    tokenizer: Tokenizer
    config: ModelConfig
    model_dir: Path
    model_name: str
    backend: GpuBackend | None
    model: Model | None
    max_model_len: int
    settings: EngineSettings
    on_close: Callable[[], None] = lambda: None
    on_watch: Callable[[Callable[[str], None]], None] = field(default=lambda callback: None)
    ranks: RankExecutor | None = None  # the executor over the rank processes, if any
    num_pages: tuple[int, ...] = ()  # each cache group's pages (KV blocks or state slots)
    weight_bytes: int = 0  # the weights as the device holds them (FP8 projections: a byte an element)
    expert_bytes: int = 0  # the routed experts among them when FP8 (0: bf16, `routed_expert_bytes`)
    # work left from startup, one piece a call, for when no step is in flight (deferred decode
    # graphs); returns False once nothing is left
    idle_work: Callable[[], bool] = lambda: False

    def close(self) -> None:
        """Release what the engine holds outside this thread (its mask thread, rank processes)
        and its device memory; the engine must not run again."""
        self.core.close()
        self.on_close()

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call `on_failure(message)` if the engine's other processes fail outside a step."""
        self.on_watch(on_failure)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The largest step a worker runs: tokens, and rows sampled (also its graphs' batch)."""

    max_tokens: int
    max_rows: int


class ModelPlacement(Protocol):
    """Where the weights go: the whole model on one device, or one tensor-parallel rank's part
    (`rank_engine.RankPart`)."""

    def make_backend(self, settings: EngineSettings, config: ModelConfig) -> GpuBackend: ...

    def weight_bytes(self, checkpoint_bytes: int) -> int:
        """This placement's share of the weights' device bytes (`checkpoint_bytes`: the whole
        model's), for the check before loading."""
        ...

    def load(self, config: ModelConfig, weights: WeightSource, backend: GpuBackend, max_positions: int,
             limits: StepLimits, progress: Callable[[int, int], None]) -> Model: ...


class OneDevice:
    """The whole model on one device."""

    def make_backend(self, settings: EngineSettings, config: ModelConfig) -> GpuBackend:
        return make_backend(settings.device, config.model_type, settings.dtype, settings.batch_invariant)

    def weight_bytes(self, checkpoint_bytes: int) -> int:
        return checkpoint_bytes

    def load(self, config: ModelConfig, weights: WeightSource, backend: GpuBackend, max_positions: int,
             limits: StepLimits, progress: Callable[[int, int], None]) -> Model:
        return load_model(config, weights, backend, max_positions=max_positions, progress=progress)


def read_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{model_dir} has no config.json; is it a Hugging Face model folder?") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON ({exc}); re-download or re-import the model") from None
    return ModelConfig.from_dict(raw)


def open_weights(model_dir: Path, config: ModelConfig) -> WeightSource:
    """The folder's safetensors, or the generated weights of a benchmark folder that has none
    (`atlas bench --random` of a model too large to write; see `bench/random_model.py`)."""
    from atlas.app.bench.random_model import open_generated

    return open_generated(model_dir, config.raw) or SafetensorsWeights(model_dir)


def build_engine(
    settings: EngineSettings, show_progress: bool = True, placement: ModelPlacement | None = None,
    defer_graphs: bool = False,
) -> LoadedEngine:
    """Load a model and wire an engine; every user mistake raises a ValueError naming the fix.
    With --tensor-parallel-size > 1 the model runs on rank processes
    (`parallel_engine.py`); each rank builds its part through here with its `placement`.
    `defer_graphs` (a server's engine process): capture the decode graphs of up to
    STARTUP_GRAPH_BATCH sequences now and leave the rest to `LoadedEngine.idle_work`."""
    if placement is None and settings.is_parallel:
        from atlas.app.parallel_engine import build_parallel_engine

        return build_parallel_engine(settings, show_progress)
    is_rank = placement is not None  # a rank only executes: the driver's core applies constraints
    placement = placement or OneDevice()
    phases = PhaseTimer()
    model_dir = resolve_model(settings.model)
    config = read_model_config(model_dir)
    check_supported(config)
    quantize = settings.quantization != "none"
    if quantize:
        config = ModelConfig.from_dict(with_quantization(config.raw, settings.quantization))
    quantization = check_quantization(config.raw, fp8_layouts(config), config.architecture)
    tokenizer = HfTokenizer.from_folder(model_dir)
    stored = open_weights(model_dir, config)
    weights = QuantizedOnLoad(stored) if quantize else stored
    max_model_len = settings.max_seq_len or config.max_position_embeddings
    speculative = settings.speculative
    draft = None
    if speculative is not None and speculative.method is SpeculativeMethod.DRAFT_MODEL:
        draft = open_draft_model(speculative.model, tokenizer)  # type: ignore[arg-type]
    head_checkpoint = None
    if speculative is not None and speculative.method in (SpeculativeMethod.MTP, SpeculativeMethod.EAGLE3):
        head_checkpoint = open_head(speculative, config)

    phases.lap("model files", f"{model_dir.name}: config, tokenizer, weight headers")
    backend = placement.make_backend(settings, config)
    phases.lap("backend", f"{backend.name}: libraries, device, kernels started")
    check_speculation_fits(settings, config, backend)
    free_bytes, total_bytes = backend.memory_info()
    weight_bytes = placement.weight_bytes(checkpoint_bytes(stored, quantize))
    # FP8 experts are held a byte an element: the bench's roofline reads them as the device holds them
    expert_bytes = (checkpoint_bytes(stored, quantize, include=lambda name: ".experts." in name)
                    if quantization is not None and config.num_experts else 0)
    weight_bytes += draft.weight_bytes if draft is not None else 0
    weight_bytes += head_checkpoint.weight_bytes if head_checkpoint is not None else 0
    check_weights_fit(weight_bytes, free_bytes, total_bytes, settings.gpu_memory_utilization)
    log.info(
        "loading %s (%s, %.2f GiB%s) on %s", model_dir, config.architecture, weight_bytes / GIB,
        "" if quantization is None else f", {quantization.describe()}", backend.name,
    )
    max_num_tokens = settings.max_prefill_tokens
    verify_rows = _max_verify_rows(settings, speculative)
    num_drafts = speculative.num_speculative_tokens if speculative is not None else 0
    if Kind.RECURRENT in model_kinds(config):
        # a verify step of a model with recurrent layers runs eagerly (its recurrent groups see
        # each verify chunk whole): graphs of verify sizes would never replay
        graph_sizes = () if settings.enforce_eager else _graph_sizes(settings, 0)
    else:
        graph_sizes = () if settings.enforce_eager else _graph_sizes(settings, verify_rows, num_drafts)
    max_rows = max(settings.max_num_seqs, verify_rows, max(graph_sizes, default=0))
    limits = StepLimits(max(max_num_tokens, max_rows), max_rows)
    progress = Progress(f"loading {config.architecture} weights", enabled=show_progress)
    model = placement.load(config, weights, backend, max_model_len, limits, progress.update)
    draft_model = load_draft_model(draft, backend, max_model_len) if draft is not None else None
    head = None
    if head_checkpoint is not None:
        head_tokens = max(max_num_tokens, settings.max_num_seqs, max(graph_sizes, default=0))
        head = load_head(head_checkpoint, config, weights, model, max_model_len, head_tokens)
        draft_model = head.model
    backend.synchronize()  # the copies are in: the phase's rate is the real one
    phases.lap("weights", lambda seconds: f"{weight_bytes / GIB:.2f} GiB, {weight_bytes / seconds / 1e9:.2f} GB/s")

    kv_dtype = _kv_dtype(settings.kv_cache_dtype, backend)
    kv_budget = settings.kv_cache_gb if settings.kv_cache_gb is not None else (
        MOCK_KV_CACHE_GB if backend.name == "mock" else None
    )
    free_bytes, total_bytes = backend.memory_info()
    # A draft model's full-attention groups join the target's: the plan gives every such group
    # the same block count, so the draft holds as many tokens as the target.
    draft_groups = draft_model.cache_groups if draft_model is not None else ()
    draft_workspace = draft_model.workspace_bytes(max_num_tokens, settings.max_num_seqs) if draft_model else 0
    keep = head.target_layers if head is not None else ()
    # the worker's copies of the kept layers' rows (allocated after the plan, so counted here)
    kept_bytes = len(keep) * limits.max_tokens * model.hidden_size * backend.capabilities.activation_dtype.itemsize
    plan = plan_cache(
        free_bytes=free_bytes,
        total_bytes=total_bytes,
        utilization=settings.gpu_memory_utilization,
        reserved_bytes=model.workspace_bytes(limits.max_tokens, limits.max_rows) + draft_workspace + kept_bytes,
        groups=(*model.cache_groups, *draft_groups),
        kv_dtype=kv_dtype,
        block_size=settings.block_size,
        demand=CacheDemand(settings.max_num_seqs, max_num_tokens, max_model_len, _num_state_snapshots(settings)),
        kv_budget_bytes=int(kv_budget * GIB) if kv_budget is not None else None,
    )
    num_pages = plan.num_pages[: len(model.cache_groups)]
    scales = kv_cache_scales(config, weights) if kv_dtype.is_quantized else ()
    caches = allocate_caches(backend, model.cache_groups, num_pages, settings.block_size, kv_dtype, scales)
    _log_caches(model, plan, kv_dtype)

    worker = Worker(
        backend,
        model,
        caches,
        WorkerConfig(max_num_tokens, max(settings.max_num_seqs, verify_rows), max_model_len, graph_sizes, keep,
                     num_drafts, 0 if settings.enforce_eager else PIECE_MAX_TOKENS),
    )
    proposer: DraftModelProposer | DraftHeadProposer | None = None
    if head is not None:
        proposer = head_proposer(settings, head, plan.num_pages[len(model.cache_groups):], kv_dtype, max_model_len,
                                 () if settings.enforce_eager else _graph_sizes(settings, 0), config.vocab_size)
    elif draft is not None and draft_model is not None:
        proposer = _draft_proposer(settings, draft, draft_model, plan.num_pages[len(model.cache_groups):], kv_dtype,
                                   max_model_len, () if settings.enforce_eager else _graph_sizes(settings, 0),
                                   min(config.vocab_size, draft.config.vocab_size))
    phases.lap("memory plan", f"{sum(plan.num_pages)} pages, step buffers and workspace")
    up_to = STARTUP_GRAPH_BATCH if defer_graphs and not is_rank else None
    if worker.graph_batch_sizes:
        now = [size for size in worker.graph_batch_sizes if up_to is None or size <= up_to]
        log.info("capturing decode graphs for batch sizes %s", ", ".join(map(str, now)))
        worker.capture_graphs(up_to)
    # Ranks skip it: each rank's store could answer differently, and their forwards must pair.
    warmed = () if is_rank else worker.warm_up(_products_key(config, settings))
    tuning = backend.setup_summary()
    sizes = worker.graph_batch_sizes
    captured = f"{len(sizes)} decode graphs (batch {sizes[0]}-{sizes[-1]})" if sizes else "no graphs (eager)"
    if worker.num_deferred_graphs:
        captured = (f"{len(sizes) - worker.num_deferred_graphs} of {captured}, "
                    f"{worker.num_deferred_graphs} more when idle")
    if worker.piece_buckets:
        captured += (f"; layer pieces for steps of up to {worker.piece_buckets[-1]} tokens "
                     f"{'when idle' if up_to is not None else 'on first use'}")
    if warmed:
        captured += f"; warm-up forwards of {', '.join(map(str, warmed))} tokens"
    phases.lap("graphs", f"{captured}; {tuning}" if tuning else captured)
    grammars = None if is_rank else engine_grammars(tokenizer, model_dir, config.vocab_size)
    grammar_worker = None
    if grammars is not None and uses_grammar_process(settings, backend.name):
        grammar_worker = grammar_process(model_dir, config.vocab_size, tokenizer.eos_token_ids, max_rows)
    core = make_core(settings, model.cache_groups, num_pages, worker, max_model_len, config.vocab_size, tokenizer,
                     grammars, proposer, grammar_worker)
    return LoadedEngine(
        core=core,
        tokenizer=tokenizer,
        config=config,
        model_dir=model_dir,
        model_name=settings.model,
        backend=backend,
        model=model,
        max_model_len=max_model_len,
        settings=settings,
        num_pages=tuple(num_pages),
        weight_bytes=weight_bytes,
        expert_bytes=expert_bytes,
        idle_work=worker.capture_next_graph,
        # A CUDA backend gives its device memory back (the mock's arrays go with the objects).
        on_close=getattr(backend, "close", lambda: None),
    )


def _products_key(config: ModelConfig, settings: EngineSettings) -> str:
    """What decides a model's GEMM shapes (its config and the load-time quantization), hashed:
    the key a backend records startup warm-ups under (`Worker.warm_up`)."""
    text = json.dumps(config.raw, sort_keys=True, default=str) + settings.quantization
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def engine_grammars(tokenizer: HfTokenizer, model_dir: Path, vocab_size: int) -> GrammarCache:
    """The engine's grammar cache for requests' constraints (its compiler is built on first use)."""
    return GrammarCache(LazyGrammarCompiler(tokenizer, model_dir, vocab_size))


# auto's floor: the engine thread, the helper and llguidance's two fill threads each want a core
# (on the 2-core CI box the helper lost to the mask thread; docs/lab/host-gap.md)
GRAMMAR_PROCESS_MIN_CORES = 8


def uses_grammar_process(settings: EngineSettings, backend_name: str, cores: int | None = None,
                         machine: str | None = None) -> bool:
    """Whether --grammar-process puts the grammar state in a helper process. auto: on for CUDA
    on an x86-64 host with GRAMMAR_PROCESS_MIN_CORES usable cores or more (an H200 host, 16
    cores: json / free at batch 16 96.0-96.7% against 89.2-90.9% on the mask thread), off
    otherwise. The helper's control words rely on x86-64's store order (a store is seen after
    the stores before it), so `on` elsewhere is refused. `cores` and `machine` default to this
    process's CPU affinity and `platform.machine()`."""
    machine = platform.machine() if machine is None else machine
    x86 = machine.lower() in ("x86_64", "amd64")
    if settings.grammar_process == "off":
        return False
    if settings.grammar_process == "on":
        if not x86:
            raise SettingsError(f"--grammar-process on: the grammar helper process needs an x86-64 host (its "
                                f"shared-memory words rely on x86's store order); this one is {machine}: use off")
        return True
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return backend_name == "cuda" and x86 and cores >= GRAMMAR_PROCESS_MIN_CORES


def grammar_process(model_dir: Path, vocab_size: int, eos_token_ids: frozenset[int],
                    max_rows: int) -> Callable[[], GrammarWorker]:
    """Starts a grammar helper process for the model (`atlas.adapters.grammar.process`): the
    first one now, so it is ready by the first constrained request; another after one died."""
    from atlas.adapters.grammar.process import GrammarProcess

    def start() -> GrammarProcess:
        return GrammarProcess(functools.partial(process_grammars, str(model_dir), vocab_size), eos_token_ids, max_rows,
                              (vocab_size + 31) // 32)

    first: list[GrammarProcess] = [start()]
    return lambda: first.pop() if first else start()


def make_core(settings: EngineSettings, groups: Sequence[CacheGroupSpec], num_pages: Sequence[int],
              executor: StepExecutor, max_model_len: int, vocab_size: int, tokenizer: Tokenizer,
              grammars: GrammarCache | None = None,
              draft: DraftModelProposer | DraftHeadProposer | None = None,
              grammar_worker: Callable[[], GrammarWorker] | None = None) -> EngineCore:
    """The engine core over the model's cache groups, group i with `num_pages[i]` pages,
    driving `executor`, compiling requests' grammars with `grammars` (None: refusing them) or in
    the workers `grammar_worker` starts, drafting with `draft` under a draft_model, mtp or
    eagle3 configuration. Raises SettingsError for a speculative configuration the model cannot
    run."""
    speculation = speculation_policy(settings.speculative, draft)
    cache = CacheManager.for_groups(groups, num_pages, settings.block_size, settings.prefix_caching)
    if settings.prefix_caching and not cache.caches_prefixes:
        log.info("prefix caching is off: the recurrent layers keep no state at block boundaries to start a hit from")
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_prefill_tokens,
            block_size=settings.block_size,
            max_admitted_tokens=settings.admitted_tokens,
        ),
        cache,
        POLICIES[settings.scheduling_policy](),
        speculation,
    )
    return EngineCore(scheduler, executor, max_model_len, vocab_size, tokenizer.eos_token_ids, grammars,
                      grammar_worker)


def _draft_proposer(settings: EngineSettings, draft: DraftCheckpoint, model: Model, num_pages: Sequence[int],
                    kv_dtype: DType, max_model_len: int, graph_sizes: tuple[int, ...],
                    vocab_size: int) -> DraftModelProposer:
    """The draft model's caches (`num_pages` blocks per group, from the joint plan), its worker
    on the target's backend and the proposer over them."""
    scales = kv_cache_scales(draft.config, draft.weights) if kv_dtype.is_quantized else ()
    caches = allocate_caches(model.backend, model.cache_groups, num_pages, settings.block_size, kv_dtype, scales)
    config = WorkerConfig(settings.max_prefill_tokens, settings.max_num_seqs, max_model_len, graph_sizes)
    log.info("draft model %s: %d KV blocks of %d tokens", draft.model_dir, num_pages[0], settings.block_size)
    worker = Worker(model.backend, model, caches, config)
    worker.capture_graphs()  # its decode steps (drafts 1 .. k - 1) replay them
    return DraftModelProposer(worker, num_pages[0], settings.block_size, settings.max_prefill_tokens, vocab_size)


def _log_caches(model: Model, plan: CachePlan, kv_dtype: DType) -> None:
    num_groups = len(model.cache_groups)  # the plan's later groups are a draft model's
    for group, pages, size in zip(model.cache_groups, plan.num_pages[:num_groups], plan.bytes_per_page[:num_groups],
                                  strict=True):
        layers = f"{len(group.layers)} of {len(model.layers)} layers"
        if group.kind is CacheGroupKind.RECURRENT_STATE:
            log.info("recurrent state: %d slots (%s, %.1f KiB a slot)", pages, layers, size / 2**10)
            continue
        window = f", window {group.window}" if group.window is not None else ""
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %s%s, %.2f GiB, %s)",
            pages, plan.block_size, pages * plan.block_size, layers, window, pages * size / GIB, kv_dtype.value,
        )


def _kv_dtype(name: str, backend: GpuBackend) -> DType:
    if name == "auto":
        return backend.capabilities.activation_dtype
    dtype = _KV_DTYPES[name]
    supported = backend.capabilities.kv_dtypes
    if dtype not in supported:
        names = ", ".join(key for key, value in _KV_DTYPES.items() if value in supported)
        raise ValueError(f"--kv-cache-dtype {name} is not supported on {backend.name}; use auto or one of {names}")
    return dtype


def check_speculation_fits(settings: EngineSettings, config: ModelConfig, backend: GpuBackend) -> None:
    """Before any weight is read: refuse --speculative-config for a model with recurrent layers
    on a backend whose recurrent kind writes no state snapshots (rejected drafts could not be
    rolled back). Raises SettingsError naming the missing capability."""
    if settings.speculative is None or Kind.RECURRENT not in model_kinds(config):
        return
    if not backend.capabilities.state_snapshots:
        raise SettingsError(
            f"--speculative-config: {config.architecture} has recurrent layers and the {backend.name} backend's "
            f"recurrent kernels write no state snapshots (Capabilities.state_snapshots), so rejected drafts "
            f"cannot be rolled back; drop --speculative-config"
        )


def _num_state_snapshots(settings: EngineSettings) -> int:
    """Snapshot slots each recurrent group needs for verification: one per draft of each
    sequence that may speculate (every running one, within --speculative-config's
    disable_by_batch_size)."""
    speculative = settings.speculative
    if speculative is None:
        return 0
    num_seqs = min(settings.max_num_seqs, speculative.disable_by_batch_size or settings.max_num_seqs)
    return num_seqs * speculative.num_speculative_tokens


def _max_verify_rows(settings: EngineSettings, speculative: SpeculativeConfig | None) -> int:
    """Rows of the largest verify step (a row per token: each speculating sequence's last token
    and drafts), 0 without speculation: every sequence of a step that may speculate, within the
    token budget."""
    if speculative is None:
        return 0
    num_seqs = min(settings.max_num_seqs, speculative.disable_by_batch_size or settings.max_num_seqs)
    return min(num_seqs * (1 + speculative.num_speculative_tokens), settings.max_prefill_tokens)


def _graph_sizes(settings: EngineSettings, verify_rows: int, num_drafts: int = 0) -> tuple[int, ...]:
    """Decode batch sizes to capture; verify steps run as decode steps of `verify_rows` rows at
    most. With `num_drafts` drafts a sequence, the full verify steps of 1, 2 and 4 sequences
    get graphs of their own size, so a batch-1 verify step of k = 4 replays 5 rows, not 8."""
    largest = max(settings.max_batch_size or settings.max_num_seqs, verify_rows)
    verify_sizes = {(1 + num_drafts) * batch for batch in (1, 2, 4)} if num_drafts else set()
    sizes = sorted({size for size in (*GRAPH_BATCH_SIZES, *verify_sizes) if size <= largest} | {largest})
    return tuple(sizes)
