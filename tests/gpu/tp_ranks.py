"""Rank processes for the multi-GPU tensor-parallel checks (test_parallel_models.py).

Each rank loads its part of a safetensors folder the test wrote (through the rank's own partial
reads) on its GPU, joins the others with NCCL and the P2P all-reduce, and answers each
`LogitsRequest` with the logits of one step, eager or replayed from a captured graph.
"""

from __future__ import annotations

import msgspec
import numpy as np

from atlas.app.ranks import RankContext
from atlas.domain.batch import ScheduledBatch
from atlas.ports.gpu import DType

BLOCK_SIZE = 16
NUM_BLOCKS = 257  # the last is the workers' scratch


class LogitsRequest(msgspec.Struct):
    batch: ScheduledBatch
    graph: bool  # replay the captured decode graph of the batch's size (eager otherwise)


class LogitsRank:
    def __init__(self, context: RankContext, folder: str, expert_parallel: int, kernel_cache_dir: str,
                 graph_sizes: tuple[int, ...]) -> None:
        from atlas.adapters.cuda import CudaGpuBackend
        from atlas.adapters.cuda.custom_allreduce import FastAllReduceComm
        from atlas.adapters.weights.safetensors import SafetensorsWeights
        from atlas.app.builder import read_model_config
        from atlas.domain.models.parallel_model import load_rank_model
        from atlas.domain.parallel import RankPlacement
        from atlas.domain.worker import Worker, WorkerConfig
        from atlas.domain.device_caches import allocate_caches

        from pathlib import Path

        config = read_model_config(Path(folder))
        self.backend = CudaGpuBackend(context.device_ordinal, kernel_cache_dir, model_hint=config.model_type)
        self.comm = FastAllReduceComm.connect(self.backend.runtime, context.rank, context.world_size, context.comm_id)
        placement = RankPlacement(context.rank, context.world_size, expert_parallel)
        max_rows = max((64, *graph_sizes))
        model = load_rank_model(config, SafetensorsWeights(folder), self.backend, self.comm, placement, 2048,
                                max_tokens=1024, max_rows=max_rows)

        def cache():
            groups = model.cache_groups
            return allocate_caches(self.backend, groups, [NUM_BLOCKS] * len(groups), BLOCK_SIZE, DType.BF16)

        self.eager = Worker(self.backend, model, cache(), WorkerConfig(1024, max_rows, 2048))
        self.graphs = Worker(self.backend, model, cache(), WorkerConfig(1024, max_rows, 2048, graph_sizes))
        self.graphs.capture_graphs()
        self._decode = msgspec.msgpack.Decoder(LogitsRequest).decode

    def loaded(self) -> bytes:
        return b""

    def step(self, body: bytes) -> bytes:
        request = self._decode(body)
        worker = self.graphs if request.graph else self.eager
        return np.ascontiguousarray(worker.compute_logits(request.batch), np.float32).tobytes()

    def close(self) -> None:
        self.comm.close()
        self.backend.close()


def logits_rank(context: RankContext, folder: str, expert_parallel: int, kernel_cache_dir: str,
                graph_sizes: tuple[int, ...]) -> LogitsRank:
    return LogitsRank(context, folder, expert_parallel, kernel_cache_dir, graph_sizes)
