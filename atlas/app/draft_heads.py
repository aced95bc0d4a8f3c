"""Loading the draft head of `--speculative-config '{"method": "mtp" | "eagle3", ...}'`.

MTP runs the multi-token-prediction layers the target checkpoint carries (Qwen3-Next's `mtp.*`);
EAGLE-3 a head checkpoint of its own (`atlas.app.eagle3`). Either becomes a `Model` on the
target's backend that reads the target's kept hidden states (`atlas.domain.models.draft_heads`);
the builder plans its KV cache with the target's and wires a second `Worker` over it into a
`DraftHeadProposer`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from atlas.app.settings import EngineSettings, SettingsError
from atlas.domain.device_caches import allocate_caches
from atlas.domain.models import qwen3_next
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.draft_heads import HeadWorker, HiddenInput, mtp_head
from atlas.domain.models.model import Model
from atlas.domain.speculative.config import SpeculativeConfig, SpeculativeMethod
from atlas.domain.speculative.draft_head import DraftHeadProposer
from atlas.domain.worker import Worker, WorkerConfig
from atlas.ports.gpu import DType, GpuBackend
from atlas.ports.weights import WeightSource

log = logging.getLogger("atlas")

_FLAG = "--speculative-config: speculative_config.method"


@dataclass(frozen=True, slots=True)
class LoadedHead:
    """A draft head on the target's backend, and what the target's worker must keep for it."""

    model: Model
    inputs: HiddenInput
    target_layers: tuple[int, ...]  # the target layers whose outputs the head reads, side by side
    target_width: int  # the width of those rows: H x len(target_layers)
    description: str


def check_head_target(speculative: SpeculativeConfig, config: ModelConfig) -> None:
    """Before any weight is read: refuse mtp for a target family without MTP layers. Raises
    SettingsError naming the flag."""
    if speculative.method is SpeculativeMethod.EAGLE3:
        raise SettingsError(f"{_FLAG}: eagle3 is not supported by the engine yet; use mtp, ngram or draft_model")
    if speculative.method is SpeculativeMethod.MTP and config.architecture not in qwen3_next.ARCHITECTURES:
        raise SettingsError(
            f"{_FLAG}: mtp runs the MTP layers of a Qwen3-Next-family checkpoint; {config.architecture} has none "
            "Atlas can run; use ngram, draft_model or eagle3"
        )


def load_head(speculative: SpeculativeConfig, config: ModelConfig, weights: WeightSource, target: Model,
              max_model_len: int, max_tokens: int) -> LoadedHead:
    """The draft head of an mtp configuration, on the target's backend, for steps of up to
    `max_tokens` tokens. Raises SettingsError when the checkpoint carries no MTP layers."""
    backend = target.backend
    mtp = qwen3_next.load_mtp(config, weights, backend, max_model_len)
    if mtp is None:
        raise SettingsError(f"{_FLAG}: mtp: the checkpoint carries no MTP layers (mtp.* tensors); use ngram or "
                            "draft_model")
    model, inputs = mtp_head(mtp, backend, max_tokens, config.vocab_size)
    last = len(target.layers) - 1
    return LoadedHead(model, inputs, (last,), config.hidden_size, f"MTP head ({len(mtp.layers)} layers)")


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
    return DraftHeadProposer(HeadWorker(worker, head.inputs, head.target_width), num_pages[0], settings.block_size,
                             settings.max_prefill_tokens, vocab_size)
