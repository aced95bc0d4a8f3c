"""The composition root: settings in, a running engine out.

Resolves the model, reads its config, checks memory before committing to anything, loads the
weights onto the chosen backend, sizes the KV cache, and wires scheduler, worker and engine.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.adapters.weights.safetensors import SafetensorsWeights
from atlas.app.backends import make_backend
from atlas.app.model_store import resolve_model
from atlas.app.progress import Progress
from atlas.app.settings import EngineSettings
from atlas.domain.cache.manager import CacheManager
from atlas.domain.device_caches import allocate_caches
from atlas.domain.engine import EngineCore
from atlas.domain.memory_plan import GIB, CacheDemand, CachePlan, check_weights_fit, plan_cache
from atlas.domain.models.cache_groups import CacheGroupKind
from atlas.domain.models.config import ModelConfig, ModelConfigError
from atlas.domain.models.families import check_supported, kv_cache_scales, load_model
from atlas.domain.models.model import Model
from atlas.domain.models.quantization import check_quantization
from atlas.domain.scheduler import Scheduler, SchedulerConfig
from atlas.domain.scheduling_policy import POLICIES
from atlas.domain.worker import Worker, WorkerConfig
from atlas.ports.gpu import DType, GpuBackend
from atlas.ports.tokenizer import Tokenizer

log = logging.getLogger("atlas")

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MOCK_KV_CACHE_GB = 2.0
_KV_DTYPES = {"bf16": DType.BF16, "f16": DType.F16, "f32": DType.F32, "fp8": DType.FP8_E4M3, "fp8_e4m3": DType.FP8_E4M3}


@dataclass
class LoadedEngine:
    """Everything a front end needs: the engine core, the tokenizer and the model's identity."""

    core: EngineCore
    tokenizer: Tokenizer
    config: ModelConfig
    model_dir: Path
    model_name: str
    backend: GpuBackend
    model: Model
    max_model_len: int
    settings: EngineSettings


def read_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{model_dir} has no config.json; is it a Hugging Face model folder?") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON ({exc}); re-download or re-import the model") from None
    return ModelConfig.from_dict(raw)


def build_engine(settings: EngineSettings, show_progress: bool = True) -> LoadedEngine:
    """Load a model and wire an engine; every user mistake raises a ValueError naming the fix."""
    model_dir = resolve_model(settings.model)
    config = read_model_config(model_dir)
    check_supported(config)
    check_quantization(config.raw, loadable=())  # FP8 weights load once the dense kind takes them
    tokenizer = HfTokenizer.from_folder(model_dir)
    weights = SafetensorsWeights(model_dir)
    max_model_len = settings.max_seq_len or config.max_position_embeddings

    backend = make_backend(settings.device, config.model_type, settings.dtype)
    free_bytes, total_bytes = backend.memory_info()
    weight_bytes = _weight_bytes(weights)
    check_weights_fit(weight_bytes, free_bytes, total_bytes, settings.gpu_memory_utilization)
    log.info("loading %s (%s, %.2f GiB in bf16) on %s", model_dir, config.architecture, weight_bytes / GIB, backend.name)
    progress = Progress(f"loading {config.architecture} weights", enabled=show_progress)
    model = load_model(config, weights, backend, max_positions=max_model_len, progress=progress.update)

    kv_dtype = _kv_dtype(settings.kv_cache_dtype, backend)
    max_num_tokens = settings.max_prefill_tokens
    graph_sizes = () if settings.enforce_eager else _graph_sizes(settings)
    max_rows = max(settings.max_num_seqs, max(graph_sizes, default=0))
    kv_budget = settings.kv_cache_gb if settings.kv_cache_gb is not None else (
        MOCK_KV_CACHE_GB if backend.name == "mock" else None
    )
    free_bytes, total_bytes = backend.memory_info()
    plan = plan_cache(
        free_bytes=free_bytes,
        total_bytes=total_bytes,
        utilization=settings.gpu_memory_utilization,
        reserved_bytes=model.workspace_bytes(max(max_num_tokens, max_rows), max_rows),
        groups=model.cache_groups,
        kv_dtype=kv_dtype,
        block_size=settings.block_size,
        demand=CacheDemand(settings.max_num_seqs, max_num_tokens, max_model_len),
        kv_budget_bytes=int(kv_budget * GIB) if kv_budget is not None else None,
    )
    scales = kv_cache_scales(config, weights) if kv_dtype.is_quantized else ()
    caches = allocate_caches(backend, model.cache_groups, plan.num_pages, settings.block_size, kv_dtype, scales)
    _log_caches(model, plan, kv_dtype)

    worker = Worker(
        backend,
        model,
        caches,
        WorkerConfig(max_num_tokens, settings.max_num_seqs, max_model_len, graph_sizes),
    )
    if worker.graph_batch_sizes:
        log.info("capturing decode graphs for batch sizes %s", ", ".join(map(str, worker.graph_batch_sizes)))
        worker.capture_graphs()
    cache = CacheManager.for_groups(model.cache_groups, plan.num_pages, settings.block_size, settings.prefix_caching)
    if settings.prefix_caching and not cache.caches_prefixes:
        log.info("prefix caching is off: the recurrent layers keep no state at block boundaries to start a hit from")
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=max_num_tokens,
            block_size=settings.block_size,
        ),
        cache,
        POLICIES[settings.scheduling_policy](),
    )
    core = EngineCore(scheduler, worker, max_model_len, config.vocab_size, tokenizer.eos_token_ids)
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
    )


def _weight_bytes(weights: SafetensorsWeights) -> int:
    """What the checkpoint's tensors take on a device in bf16, read from the headers alone
    (every family, MoE experts included); a multi-token-prediction head (`mtp.*`) is loaded only
    when speculative decoding asks for it, so it is not counted."""
    total = 0
    for name in weights.names():
        if not name.startswith("mtp."):
            total += math.prod(weights.shape(name))
    return 2 * total


def _log_caches(model: Model, plan: CachePlan, kv_dtype: DType) -> None:
    for group, pages, size in zip(model.cache_groups, plan.num_pages, plan.bytes_per_page, strict=True):
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


def _graph_sizes(settings: EngineSettings) -> tuple[int, ...]:
    largest = settings.max_batch_size or settings.max_num_seqs
    sizes = tuple(size for size in GRAPH_BATCH_SIZES if size <= largest)
    return sizes if largest in sizes else (*sizes, largest)
