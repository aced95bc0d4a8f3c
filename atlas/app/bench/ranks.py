"""What `atlas bench engine` measures on each rank of a model split over devices.

The per-rank roofline: a decode step on rank r cannot beat (the weight bytes rank r reads + its
KV bytes) / its device's copy bandwidth, since every rank reads its part at once. The time in
collectives: the step's collectives (`parallel_model.step_collectives`: one all-reduce of the
residual stream per mixer and feed-forward and for the embedding, one all-gather of the logits)
run alone on the rank's communicator, back to back in a captured graph where the device has
graphs, so the figure is what they add to a replayed decode step.
"""

from __future__ import annotations

import time

import numpy as np

from atlas.app.bench.measure import measure_ceilings
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.model import Model
from atlas.domain.models.parallel_model import Collective, CollectiveOp, step_collectives
from atlas.domain.parallel import RankPlacement
from atlas.ports.comm import CommBackend
from atlas.ports.gpu import GpuBackend

_REPEATS = 20


def rank_weight_bytes_per_step(config: ModelConfig, placement: RankPlacement) -> int:
    """Weight bytes a decode step of one rank reads: 1/t of every matrix (the embedding table
    only where tied, as the LM head) plus the KV-head rows it holds beyond its 1/t where KV
    heads are replicated. Norms and routers (kept whole) are neglected."""
    ranks = placement.tensor_parallel
    total = 2 * config.num_parameters()
    if not config.tie_word_embeddings:
        total -= 2 * config.vocab_size * config.hidden_size
    kv_start, kv_stop = placement.kv_heads(config.num_kv_heads)
    replicated = (kv_stop - kv_start) - config.num_kv_heads / ranks
    extra = config.num_layers * 2 * replicated * config.head_dim * config.hidden_size * 2
    return int(total / ranks + extra)


def rank_kv_bytes_per_token(config: ModelConfig, placement: RankPlacement, itemsize: int) -> int:
    """KV bytes one token of context costs one rank: its KV heads of every layer."""
    kv_start, kv_stop = placement.kv_heads(config.num_kv_heads)
    return config.num_layers * 2 * (kv_stop - kv_start) * config.head_dim * itemsize


def collective_seconds(backend: GpuBackend, comm: CommBackend, collectives: list[Collective]) -> float:
    """Seconds the `collectives` take per step, run back to back (every rank calls this)."""
    buffers = []
    for collective in collectives:
        src = backend.upload(np.full((collective.rows, collective.width), 0.5, np.float32), collective.dtype)
        out = (src if collective.op is CollectiveOp.ALL_REDUCE
               else backend.empty((comm.world_size * collective.rows, collective.width), collective.dtype))
        buffers.append((collective.op, src, out))

    def run() -> None:
        for op, src, out in buffers:
            if op is CollectiveOp.ALL_REDUCE:
                comm.all_reduce(src)
            else:
                comm.all_gather(src, out)

    run()  # warm up: lazily made buffers and NCCL channels settle outside the capture
    step = backend.capture(run).replay if backend.capabilities.supports_graphs else run
    step()
    backend.synchronize()
    started = time.perf_counter()
    for _ in range(_REPEATS):
        step()
    backend.synchronize()
    return (time.perf_counter() - started) / _REPEATS


def measure_rank(
    backend: GpuBackend, comm: CommBackend, model: Model, batch_sizes: list[int]
) -> tuple[float, float, list[float]]:
    """(copy bytes/s, bf16 GEMM FLOP/s, seconds in collectives per decode step of each batch size)."""
    on_mock = backend.name == "mock"  # small: every rank of the mock shares the host's cores
    ceilings = measure_ceilings(backend, copy_bytes=(32 << 20) if on_mock else (2 << 30),
                                gemm_size=256 if on_mock else 8192)
    seconds = [collective_seconds(backend, comm, step_collectives(model, batch, batch)) for batch in batch_sizes]
    return ceilings.copy_bytes_per_s, ceilings.gemm_flops_per_s, seconds
