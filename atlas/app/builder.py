"""The composition root: settings in, a running engine out.

Resolves the model, reads its config, checks memory before committing to anything, loads the
weights onto the chosen backend, sizes the KV cache, and wires scheduler, worker and engine.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.adapters.weights.safetensors import SafetensorsWeights
from atlas.app.backends import make_backend
from atlas.app.model_store import resolve_model
from atlas.app.progress import Progress
from atlas.app.settings import EngineSettings
from atlas.domain.engine import EngineCore
from atlas.domain.cache.block_pool import BlockPool
from atlas.domain.cache.manager import full_attention_cache
from atlas.domain.memory_plan import GIB, check_weights_fit, plan_kv_cache
from atlas.domain.models.config import ModelConfig, ModelConfigError
from atlas.domain.models.families import check_supported, kv_cache_scales, load_model
from atlas.domain.models.model import Model
from atlas.domain.models.quantization import check_quantization
from atlas.domain.scheduler import Scheduler, SchedulerConfig
from atlas.domain.scheduling_policy import POLICIES
from atlas.domain.speculative.config import SpeculativeConfig
from atlas.domain.speculative.policy import speculation_policy
from atlas.domain.worker import Worker, WorkerConfig
from atlas.ports.gpu import DType, GpuBackend
from atlas.ports.kernels.attention import KvCacheSpec
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
    weight_bytes = 2 * config.num_parameters()
    check_weights_fit(weight_bytes, free_bytes, total_bytes, settings.gpu_memory_utilization)
    log.info("loading %s (%s, %.2f GiB in bf16) on %s", model_dir, config.architecture, weight_bytes / GIB, backend.name)
    progress = Progress(f"loading {config.architecture} weights", enabled=show_progress)
    model = load_model(config, weights, backend, max_positions=max_model_len, progress=progress.update)
    kv_shape = model.single_kv_group()

    kv_dtype = _kv_dtype(settings.kv_cache_dtype, backend)
    max_num_tokens = settings.max_prefill_tokens
    speculative = settings.speculative
    verify_rows = _max_verify_rows(settings, speculative)
    graph_sizes = () if settings.enforce_eager else _graph_sizes(settings, verify_rows)
    max_rows = max(settings.max_num_seqs, verify_rows, max(graph_sizes, default=0))
    num_layers = len(model.layers)
    block_bytes = KvCacheSpec(num_layers, 1, settings.block_size, kv_shape.num_kv_heads, kv_shape.head_dim, kv_dtype)
    kv_budget = settings.kv_cache_gb if settings.kv_cache_gb is not None else (
        MOCK_KV_CACHE_GB if backend.name == "mock" else None
    )
    free_bytes, total_bytes = backend.memory_info()
    plan = plan_kv_cache(
        free_bytes=free_bytes,
        total_bytes=total_bytes,
        utilization=settings.gpu_memory_utilization,
        reserved_bytes=model.workspace_bytes(max(max_num_tokens, max_rows), max_rows),
        bytes_per_block=block_bytes.bytes_per_block,
        block_size=settings.block_size,
        max_model_len=max_model_len,
        kv_budget_bytes=int(kv_budget * GIB) if kv_budget is not None else None,
    )
    scales = kv_cache_scales(config, weights) if kv_dtype.is_quantized else ()
    spec = KvCacheSpec(
        num_layers, plan.num_blocks + 1, settings.block_size, kv_shape.num_kv_heads, kv_shape.head_dim, kv_dtype,
        scales,
    )
    kv = backend.attention.allocate_cache(spec)
    log.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)",
        plan.num_blocks, settings.block_size, plan.num_tokens, spec.total_bytes / GIB, kv_dtype.value,
    )

    worker = Worker(
        backend,
        model,
        kv,
        WorkerConfig(max_num_tokens, max(settings.max_num_seqs, verify_rows), max_model_len, graph_sizes),
    )
    if worker.graph_batch_sizes:
        log.info("capturing decode graphs for batch sizes %s", ", ".join(map(str, worker.graph_batch_sizes)))
        worker.capture_graphs()
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=max_num_tokens,
            block_size=settings.block_size,
        ),
        full_attention_cache(BlockPool(plan.num_blocks, settings.block_size), settings.prefix_caching),
        POLICIES[settings.scheduling_policy](),
        speculation_policy(speculative),
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


def _kv_dtype(name: str, backend: GpuBackend) -> DType:
    if name == "auto":
        return backend.capabilities.activation_dtype
    dtype = _KV_DTYPES[name]
    supported = backend.capabilities.kv_dtypes
    if dtype not in supported:
        names = ", ".join(key for key, value in _KV_DTYPES.items() if value in supported)
        raise ValueError(f"--kv-cache-dtype {name} is not supported on {backend.name}; use auto or one of {names}")
    return dtype


def _max_verify_rows(settings: EngineSettings, speculative: SpeculativeConfig | None) -> int:
    """Rows of the largest verify step (a row per token: each speculating sequence's last token
    and drafts), 0 without speculation: every sequence of a step that may speculate, within the
    token budget."""
    if speculative is None:
        return 0
    num_seqs = min(settings.max_num_seqs, speculative.disable_by_batch_size or settings.max_num_seqs)
    return min(num_seqs * (1 + speculative.num_speculative_tokens), settings.max_prefill_tokens)


def _graph_sizes(settings: EngineSettings, verify_rows: int) -> tuple[int, ...]:
    """Decode batch sizes to capture; verify steps run as decode steps of `verify_rows` rows at most."""
    largest = max(settings.max_batch_size or settings.max_num_seqs, verify_rows)
    sizes = tuple(size for size in GRAPH_BATCH_SIZES if size <= largest)
    return sizes if largest in sizes else (*sizes, largest)
