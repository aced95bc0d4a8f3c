"""The worker: runs a `ScheduledBatch` on a device and returns only the sampled ids.

It owns the persistent device buffers a step reads (token ids, positions, slots, block tables,
sampling parameters), copies each step's host arrays into them, runs the model eagerly or by
replaying a graph captured for the decode batch size, samples on the device and downloads the
ids. It never calls back into the scheduler.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from atlas.domain.batch import SamplingRow, ScheduledBatch, StepResult, TokenLogprobs
from atlas.domain.models.transformer import StepTensors, Transformer
from atlas.domain.requests import MAX_LOGPROBS
from atlas.domain.sampling import PackedSampling, pack_rows
from atlas.domain.step_inputs import HostStepInputs, build_step_inputs, pad_decode_inputs
from atlas.ports.gpu import AttentionMetadata, DType, GpuBackend, Graph, KvCache, LogprobsOut, SamplingTensors, Tensor


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    max_num_tokens: int  # tokens in one step
    max_num_seqs: int  # sequences in one step
    max_model_len: int
    graph_batch_sizes: tuple[int, ...] = ()  # decode batch sizes to capture; empty: always eager


class _StepBuffers:
    """Device buffers sized for the largest step; each step uses leading rows."""

    def __init__(self, backend: GpuBackend, tokens: int, seqs: int, table_width: int) -> None:

        def i32(*shape: int) -> Tensor:
            return backend.empty(shape, DType.I32)

        self.token_ids = i32(tokens)
        self.positions = i32(tokens)
        self.slot_mapping = i32(tokens)
        self.query_start_loc = i32(seqs + 1)
        self.seq_lens = i32(seqs)
        self.block_tables = i32(seqs, table_width)
        self.sample_indices = i32(seqs)
        self.sampled_ids = i32(seqs)
        self.sampled_logprobs = backend.empty((seqs,), DType.F32)
        self.top_ids = i32(seqs, MAX_LOGPROBS)
        self.top_logprobs = backend.empty((seqs, MAX_LOGPROBS), DType.F32)
        self.temperature = backend.empty((seqs,), DType.F32)
        self.top_k = i32(seqs)
        self.top_p = backend.empty((seqs,), DType.F32)
        self.min_p = backend.empty((seqs,), DType.F32)
        self.seeds = backend.empty((seqs,), DType.I64)
        self.counters = backend.empty((seqs,), DType.I64)
        self.repetition_penalty = backend.empty((seqs,), DType.F32)
        self.presence_penalty = backend.empty((seqs,), DType.F32)
        self.frequency_penalty = backend.empty((seqs,), DType.F32)
        self.penalty_offsets = i32(seqs + 1)
        self.bias_offsets = i32(seqs + 1)
        self._backend = backend
        self.penalty_token_ids = i32(1024)
        self.penalty_output_counts = i32(1024)
        self.bias_token_ids = i32(1024)
        self.bias_values = backend.empty((1024,), DType.F32)

    def ensure_csr_capacity(self, num_penalties: int, num_biases: int) -> None:
        """Grow the variable-length sampling arrays (they live outside captured graphs)."""
        backend = self._backend
        if num_penalties > self.penalty_token_ids.shape[0]:
            size = 1 << (num_penalties - 1).bit_length()
            self.penalty_token_ids = backend.empty((size,), DType.I32)
            self.penalty_output_counts = backend.empty((size,), DType.I32)
        if num_biases > self.bias_token_ids.shape[0]:
            size = 1 << (num_biases - 1).bit_length()
            self.bias_token_ids = backend.empty((size,), DType.I32)
            self.bias_values = backend.empty((size,), DType.F32)


class Worker:
    """Executes steps of one model on one backend."""

    def __init__(self, backend: GpuBackend, model: Transformer, kv: KvCache, config: WorkerConfig) -> None:
        self.backend = backend
        self.model = model
        self.kv = kv
        self.config = config
        block_size = kv.spec.block_size
        self.block_size = block_size
        self.table_width = -(-config.max_model_len // block_size)
        # The last physical block is scratch: padded graph rows write there, the pool never hands it out.
        self.scratch_block = kv.spec.num_blocks - 1
        max_graph = max(config.graph_batch_sizes, default=0)
        max_tokens = max(config.max_num_tokens, max_graph)
        max_seqs = max(config.max_num_seqs, max_graph)
        self.buffers = _StepBuffers(backend, max_tokens, max_seqs, self.table_width)
        self.workspace = model.allocate_workspace(max_tokens, max_seqs)
        self.graph_batch_sizes = tuple(sorted(config.graph_batch_sizes)) if backend.capabilities.supports_graphs else ()
        self._graphs: dict[int, tuple[Graph, Tensor]] = {}

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step. Raises ValueError if the batch exceeds the configured sizes."""
        if batch.is_empty:
            return StepResult(batch.step_id, ())
        rows = [seq.sampling for seq in batch.sequences if seq.sampling is not None]
        logits = self._forward(batch)
        if not rows:
            return StepResult(batch.step_id, ())
        return self._sample(batch.step_id, logits.rows(0, len(rows)), rows)

    def compute_logits(self, batch: ScheduledBatch) -> np.ndarray:
        """Run one step and return the float32 logits [R, V] of its sampling rows, unsampled."""
        num_rows = batch.num_sampled
        return self.backend.download(self._forward(batch).rows(0, num_rows))

    def _forward(self, batch: ScheduledBatch) -> Tensor:
        if batch.num_tokens > self.config.max_num_tokens or len(batch.sequences) > self.config.max_num_seqs:
            raise ValueError(
                f"step of {batch.num_tokens} tokens / {len(batch.sequences)} sequences exceeds the worker's "
                f"{self.config.max_num_tokens} / {self.config.max_num_seqs}"
            )
        inputs = build_step_inputs(batch, self.table_width, self.scratch_block)
        bucket = self._graph_bucket(batch)
        if bucket is not None:
            return self._replay(pad_decode_inputs(inputs, bucket, self.scratch_block, self.block_size), bucket)
        return self.model.forward(self._upload_inputs(inputs), self.kv, self.workspace, inputs.num_sample_rows)

    def _graph_bucket(self, batch: ScheduledBatch) -> int | None:
        if not self.graph_batch_sizes:
            return None
        if any(seq.num_tokens != 1 or seq.sampling is None for seq in batch.sequences):
            return None
        index = bisect.bisect_left(self.graph_batch_sizes, len(batch.sequences))
        return self.graph_batch_sizes[index] if index < len(self.graph_batch_sizes) else None

    def _metadata(self, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int) -> AttentionMetadata:
        buffers = self.buffers
        return AttentionMetadata(
            positions=buffers.positions.rows(0, num_tokens),
            slot_mapping=buffers.slot_mapping.rows(0, num_tokens),
            query_start_loc=buffers.query_start_loc.rows(0, num_seqs + 1),
            seq_lens=buffers.seq_lens.rows(0, num_seqs),
            block_tables=buffers.block_tables.rows(0, num_seqs),
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )

    def _upload_inputs(self, inputs: HostStepInputs) -> StepTensors:
        buffers, copy = self.buffers, self.backend.copy_from_host
        num_tokens, num_seqs, num_rows = inputs.num_tokens, inputs.num_seqs, inputs.num_sample_rows
        copy(buffers.token_ids.rows(0, num_tokens), inputs.token_ids)
        copy(buffers.positions.rows(0, num_tokens), inputs.positions)
        copy(buffers.slot_mapping.rows(0, num_tokens), inputs.slot_mapping)
        copy(buffers.query_start_loc.rows(0, num_seqs + 1), inputs.query_start_loc)
        copy(buffers.seq_lens.rows(0, num_seqs), inputs.seq_lens)
        copy(buffers.block_tables.rows(0, num_seqs), inputs.block_tables)
        copy(buffers.sample_indices.rows(0, num_rows), inputs.sample_indices)
        return StepTensors(
            token_ids=buffers.token_ids.rows(0, num_tokens),
            meta=self._metadata(num_tokens, num_seqs, inputs.max_query_len, inputs.max_seq_len),
            sample_indices=buffers.sample_indices.rows(0, num_rows),
        )

    def _replay(self, inputs: HostStepInputs, bucket: int) -> Tensor:
        """Copy the padded step into the buffers and replay (capturing on first use)."""
        step = self._upload_inputs(inputs)
        if bucket not in self._graphs:
            # Graphs are captured with the longest context so the kernels they bake in cover every step.
            graph_step = StepTensors(
                token_ids=step.token_ids,
                meta=self._metadata(bucket, bucket, 1, self.config.max_model_len),
                sample_indices=step.sample_indices,
            )
            captured: list[Tensor] = []

            def run_model() -> None:
                captured[:] = [self.model.forward(graph_step, self.kv, self.workspace, bucket)]

            run_model()  # warm up outside capture: lazy compilation and workspaces settle first
            graph = self.backend.capture(run_model)
            self._graphs[bucket] = (graph, captured[0])
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits

    def _sample(self, step_id: int, logits: Tensor, rows: list[SamplingRow]) -> StepResult:
        packed = pack_rows(rows)
        tensors = self._upload_sampling(packed)
        wanted = [row.num_logprobs for row in rows]
        num_top = max((n for n in wanted if n is not None), default=None)
        num_rows = packed.num_rows
        buffers = self.buffers
        logprobs_out = None
        if num_top is not None:
            logprobs_out = LogprobsOut(
                sampled=buffers.sampled_logprobs.rows(0, num_rows),
                top_ids=_leading_block(buffers.top_ids, num_rows, num_top),
                top_logprobs=_leading_block(buffers.top_logprobs, num_rows, num_top),
                num_top=num_top,
            )
        out_ids = buffers.sampled_ids.rows(0, num_rows)
        self.backend.sample(logits, tensors, out_ids, logprobs_out)
        token_ids = self.backend.download(out_ids)
        logprobs = None
        if logprobs_out is not None:
            logprobs = self._collect_logprobs(logprobs_out, token_ids, wanted)
        return StepResult(step_id, tuple(int(t) for t in token_ids), logprobs)

    def _upload_sampling(self, packed: PackedSampling) -> SamplingTensors:
        buffers = self.buffers
        num_rows = packed.num_rows
        num_penalties, num_biases = packed.penalty_token_ids.shape[0], packed.bias_token_ids.shape[0]
        buffers.ensure_csr_capacity(num_penalties, num_biases)

        def put(buffer: Tensor, values: np.ndarray, count: int) -> Tensor:
            view = buffer.rows(0, count)
            if count:
                self.backend.copy_from_host(view, values[:count])
            return view

        return SamplingTensors(
            temperature=put(buffers.temperature, packed.temperature, num_rows),
            top_k=put(buffers.top_k, packed.top_k, num_rows),
            top_p=put(buffers.top_p, packed.top_p, num_rows),
            min_p=put(buffers.min_p, packed.min_p, num_rows),
            seeds=put(buffers.seeds, packed.seeds, num_rows),
            counters=put(buffers.counters, packed.counters, num_rows),
            repetition_penalty=put(buffers.repetition_penalty, packed.repetition_penalty, num_rows),
            presence_penalty=put(buffers.presence_penalty, packed.presence_penalty, num_rows),
            frequency_penalty=put(buffers.frequency_penalty, packed.frequency_penalty, num_rows),
            penalty_offsets=put(buffers.penalty_offsets, packed.penalty_offsets, num_rows + 1),
            penalty_token_ids=put(buffers.penalty_token_ids, packed.penalty_token_ids, num_penalties),
            penalty_output_counts=put(buffers.penalty_output_counts, packed.penalty_output_counts, num_penalties),
            bias_offsets=put(buffers.bias_offsets, packed.bias_offsets, num_rows + 1),
            bias_token_ids=put(buffers.bias_token_ids, packed.bias_token_ids, num_biases),
            bias_values=put(buffers.bias_values, packed.bias_values, num_biases),
            num_rows=num_rows,
            all_greedy=packed.all_greedy,
            any_penalties=packed.any_penalties,
            any_bias=packed.any_bias,
        )

    def _collect_logprobs(
        self, out: LogprobsOut, token_ids: np.ndarray, wanted: list[int | None]
    ) -> tuple[TokenLogprobs | None, ...]:
        sampled = self.backend.download(out.sampled)
        top_ids = self.backend.download(out.top_ids) if out.num_top else None
        top_values = self.backend.download(out.top_logprobs) if out.num_top else None
        result: list[TokenLogprobs | None] = []
        for row, num_top in enumerate(wanted):
            if num_top is None:
                result.append(None)
                continue
            top: tuple[tuple[int, float], ...] = ()
            if num_top and top_ids is not None and top_values is not None:
                top = tuple((int(top_ids[row, k]), float(top_values[row, k])) for k in range(num_top))
            result.append(TokenLogprobs(int(token_ids[row]), float(sampled[row]), top))
        return tuple(result)


def _leading_block(buffer: Tensor, num_rows: int, num_columns: int) -> Tensor:
    """A dense [num_rows, num_columns] view over the start of a [max_rows, max_columns] buffer."""
    total = buffer.shape[0] * buffer.shape[1]
    return buffer.view(total).rows(0, num_rows * num_columns).view(num_rows, num_columns)
