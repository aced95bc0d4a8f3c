"""Loading the draft head of `--speculative-config '{"method": "mtp" | "eagle3", ...}'`.

MTP runs the multi-token-prediction layers the target checkpoint carries (Qwen3-Next's `mtp.*`);
EAGLE-3 a head checkpoint of its own, named by `model` (`atlas.domain.models.eagle3`). Either
becomes a `Model` on the target's backend that reads the target's kept hidden states
(`atlas.domain.models.draft_heads`); the builder plans its KV cache with the target's and wires
a second `Worker` over it into a `DraftHeadProposer`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atlas.app.model_store import ModelNotFoundError, resolve_model
from atlas.app.settings import EngineSettings, SettingsError
from atlas.domain.device_caches import allocate_caches
from atlas.domain.models import qwen3_next
from atlas.domain.models.checkpoint import CheckpointReader
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.draft_heads import HeadWorker, mtp_head
from atlas.domain.models.eagle3 import Eagle3Shape, TargetFacts, load_eagle3
from atlas.domain.models.model import Model
from atlas.domain.models.quantization_weights import checkpoint_bytes
from atlas.domain.speculative.config import SpeculativeConfig, SpeculativeMethod
from atlas.domain.speculative.draft_head import DraftHeadProposer
from atlas.domain.worker import Worker, WorkerConfig
from atlas.ports.gpu import DType, GpuBackend, Tensor
from atlas.ports.kernels.dense import Projection
from atlas.ports.weights import WeightSource

log = logging.getLogger("atlas")

_FLAG = "--speculative-config: speculative_config.method"
_MODEL = "--speculative-config: speculative_config.model"


@dataclass(frozen=True, slots=True)
class LoadedHead:
    """A draft head on the target's backend, and what the target's worker must keep for it."""

    model: Model
    hidden: Tensor  # the [max_tokens, H] hidden-state rows its first end reads
    target_layers: tuple[int, ...]  # the target layers whose outputs the head reads, side by side
    target_width: int  # the width of those rows: H x len(target_layers)
    description: str
    fuse: Projection | None = None  # EAGLE-3's fc: the target's rows into H
    target_ids: np.ndarray | None = None  # EAGLE-3: each draft id's target id


@dataclass(frozen=True, slots=True)
class HeadCheckpoint:
    """A checked draft head, not loaded yet: the target's own MTP layers (`model_dir` None), or
    an EAGLE-3 head's folder, config and weights."""

    method: SpeculativeMethod
    spec: str | None = None  # as `speculative_config.model` names it
    model_dir: Path | None = None
    config: ModelConfig | None = None
    weights: WeightSource | None = None

    @property
    def weight_bytes(self) -> int:
        """What its own checkpoint adds to the target's (MTP layers are counted with the target)."""
        return checkpoint_bytes(self.weights) if self.weights is not None else 0


def open_head(speculative: SpeculativeConfig, config: ModelConfig) -> HeadCheckpoint:
    """Check the head of an mtp or eagle3 configuration before any weight is read: mtp needs a
    Qwen3-Next-family target; an EAGLE-3 head must resolve to a folder whose config.json Atlas
    can run against this target. Raises SettingsError naming the flag and the key."""
    if speculative.method is SpeculativeMethod.MTP:
        if config.architecture not in qwen3_next.ARCHITECTURES:
            raise SettingsError(
                f"{_FLAG}: mtp runs the MTP layers of a Qwen3-Next-family checkpoint; {config.architecture} has none "
                "Atlas can run; use ngram, draft_model or eagle3"
            )
        return HeadCheckpoint(SpeculativeMethod.MTP)
    from atlas.app.builder import open_weights, read_model_config  # the builder imports this module

    spec: str = speculative.model  # type: ignore[assignment]
    try:
        head_dir = resolve_model(spec)
    except ModelNotFoundError as error:
        places = "; ".join(line.strip()[2:] for line in str(error).splitlines() if line.strip().startswith("- "))
        raise SettingsError(f"{_MODEL}: EAGLE-3 head {spec!r} not found (looked in: {places}); pass a folder holding "
                            "its config.json and weights, a pulled name or an HF repo id") from None
    try:
        head_config = read_model_config(head_dir)
        Eagle3Shape.from_config(head_config)
        weights = open_weights(head_dir, head_config)
    except ValueError as error:
        raise SettingsError(f"{_MODEL}: EAGLE-3 head {spec!r}: {' '.join(str(error).split())}") from None
    return HeadCheckpoint(SpeculativeMethod.EAGLE3, spec, head_dir, head_config, weights)


def load_head(head: HeadCheckpoint, config: ModelConfig, weights: WeightSource, target: Model, max_model_len: int,
              max_tokens: int) -> LoadedHead:
    """Load a checked head onto the target's backend, for steps of up to `max_tokens` tokens.
    Raises SettingsError naming the field when the checkpoint carries no MTP layers, or the
    EAGLE-3 head's tensors are missing or do not fit the target."""
    backend = target.backend
    if head.method is SpeculativeMethod.EAGLE3:
        return _load_eagle3(head, config, weights, target, max_model_len, max_tokens)
    mtp = qwen3_next.load_mtp(config, weights, backend, max_model_len)
    if mtp is None:
        raise SettingsError(f"{_FLAG}: mtp: the checkpoint carries no MTP layers (mtp.* tensors); use ngram or "
                            "draft_model")
    model, inputs = mtp_head(mtp, backend, max_tokens, config.vocab_size)
    last = len(target.layers) - 1
    return LoadedHead(model, inputs.hidden, (last,), config.hidden_size, f"MTP head ({len(mtp.layers)} layers)")


def _load_eagle3(checkpoint: HeadCheckpoint, config: ModelConfig, weights: WeightSource, target: Model,
                 max_model_len: int, max_tokens: int) -> LoadedHead:
    assert checkpoint.config is not None and checkpoint.weights is not None and checkpoint.model_dir is not None
    shape = (config.vocab_size, config.hidden_size)
    facts = TargetFacts(config.hidden_size, config.vocab_size, len(target.layers),
                        lambda: CheckpointReader(weights).array("model.embed_tokens.weight", shape))
    try:
        head = load_eagle3(checkpoint.config, checkpoint.weights, target.backend, max_model_len, max_tokens, facts)
    except ValueError as error:
        raise SettingsError(f"{_MODEL}: EAGLE-3 head {checkpoint.spec!r}: {' '.join(str(error).split())}") from None
    layers = ", ".join(str(layer) for layer in head.target_layers)
    width = len(head.target_layers) * config.hidden_size
    return LoadedHead(head.model, head.buffers.hidden, head.target_layers, width,
                      f"EAGLE-3 head {checkpoint.model_dir.name} (target layers {layers})", head.fuse, head.target_ids)


def head_proposer(settings: EngineSettings, head: LoadedHead, num_pages: Sequence[int], kv_dtype: DType,
                  max_model_len: int, graph_sizes: tuple[int, ...], vocab_size: int) -> DraftHeadProposer:
    """The head's caches (`num_pages` blocks per group, from the joint plan), its worker on the
    target's backend and the proposer over them."""
    model = head.model
    backend: GpuBackend = model.backend
    caches = allocate_caches(backend, model.cache_groups, num_pages, settings.block_size, kv_dtype, ())
    config = WorkerConfig(settings.max_prefill_tokens, settings.max_num_seqs, max_model_len, graph_sizes,
                          keep_hidden_layers=(len(model.layers) - 1,))
    log.info("%s: %d KV blocks of %d tokens", head.description, num_pages[0], settings.block_size)
    worker = Worker(backend, model, caches, config)
    worker.capture_graphs()  # its decode steps (drafts 1 .. k - 1) replay them
    runner = HeadWorker(worker, head.hidden, head.target_width, head.fuse, head.target_ids)
    return DraftHeadProposer(runner, num_pages[0], settings.block_size, settings.max_prefill_tokens, vocab_size)
