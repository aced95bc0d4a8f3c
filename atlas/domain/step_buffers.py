"""The persistent device buffers a step reads, and the copies that fill them.

Buffers are sized for the largest step; a step uses their leading rows, so a captured graph
replays over the same addresses with new contents. Token ids arrive through a *token source*:

    token_source  [ sampled ids of the previous step (S rows) | this step's host tokens (N) ]
    token_ids[i]  = token_source[token_gather[i]]

so a placeholder token (sampled by the step still in flight) is read on the device from the
previous step's samples, and the host never waits for it.
"""

from __future__ import annotations

import numpy as np

from atlas.domain.requests import MAX_LOGPROBS
from atlas.domain.sampling import PackedSampling
from atlas.domain.step_inputs import HostStepInputs
from atlas.ports.gpu import AttentionMetadata, DType, GpuBackend, SamplingTensors, Tensor

_INITIAL_CSR_CAPACITY = 1024


class StepBuffers:
    """Device buffers for steps of up to `max_tokens` tokens and `max_seqs` sequences."""

    def __init__(self, backend: GpuBackend, max_tokens: int, max_seqs: int, table_width: int) -> None:
        self._backend = backend
        self.max_seqs = max_seqs

        def i32(*shape: int) -> Tensor:
            return backend.empty(shape, DType.I32)

        def f32(*shape: int) -> Tensor:
            return backend.empty(shape, DType.F32)

        self.token_source = i32(max_seqs + max_tokens)
        self.sampled_ids = self.token_source.rows(0, max_seqs)  # written by `sample`
        self.host_tokens = self.token_source.rows(max_seqs, max_seqs + max_tokens)
        self.token_gather = i32(max_tokens)
        self.token_ids = i32(max_tokens)
        self.positions = i32(max_tokens)
        self.slot_mapping = i32(max_tokens)
        self.query_start_loc = i32(max_seqs + 1)
        self.seq_lens = i32(max_seqs)
        self.block_tables = i32(max_seqs, table_width)
        self.sample_indices = i32(max_seqs)
        self.sampled_logprobs = f32(max_seqs)
        self.top_ids = i32(max_seqs, MAX_LOGPROBS)
        self.top_logprobs = f32(max_seqs, MAX_LOGPROBS)
        self.temperature = f32(max_seqs)
        self.top_k = i32(max_seqs)
        self.top_p = f32(max_seqs)
        self.min_p = f32(max_seqs)
        self.seeds = backend.empty((max_seqs,), DType.I64)
        self.counters = backend.empty((max_seqs,), DType.I64)
        self.repetition_penalty = f32(max_seqs)
        self.presence_penalty = f32(max_seqs)
        self.frequency_penalty = f32(max_seqs)
        self.penalty_offsets = i32(max_seqs + 1)
        self.bias_offsets = i32(max_seqs + 1)
        self.penalty_token_ids = i32(_INITIAL_CSR_CAPACITY)
        self.penalty_output_counts = i32(_INITIAL_CSR_CAPACITY)
        self.bias_token_ids = i32(_INITIAL_CSR_CAPACITY)
        self.bias_values = f32(_INITIAL_CSR_CAPACITY)

    # -- step inputs ----------------------------------------------------------------------
    def upload_inputs(self, inputs: HostStepInputs, gather_always: bool) -> bool:
        """Copy a step's arrays in. Returns whether `gather_tokens` must run before the model
        (placeholders present, or `gather_always` for a captured graph that always gathers)."""
        copy = self._backend.copy_from_host
        num_tokens, num_seqs, num_rows = inputs.num_tokens, inputs.num_seqs, inputs.num_sample_rows
        gather = gather_always or inputs.has_placeholders
        if gather:
            copy(self.host_tokens.rows(0, num_tokens), inputs.token_ids)
            copy(self.token_gather.rows(0, num_tokens), inputs.token_gather)
        else:
            copy(self.token_ids.rows(0, num_tokens), inputs.token_ids)
        copy(self.positions.rows(0, num_tokens), inputs.positions)
        copy(self.slot_mapping.rows(0, num_tokens), inputs.slot_mapping)
        copy(self.query_start_loc.rows(0, num_seqs + 1), inputs.query_start_loc)
        copy(self.seq_lens.rows(0, num_seqs), inputs.seq_lens)
        copy(self.block_tables.rows(0, num_seqs), inputs.block_tables)
        if num_rows:
            copy(self.sample_indices.rows(0, num_rows), inputs.sample_indices)
        return gather

    def gather_tokens(self, num_tokens: int) -> None:
        """token_ids[:n] = token_source[token_gather[:n]] (enqueued; capturable)."""
        total = self.token_source.shape[0]
        self._backend.gather_rows(
            self.token_source.view(total, 1),
            self.token_gather.rows(0, num_tokens),
            self.token_ids.rows(0, num_tokens).view(num_tokens, 1),
        )

    def metadata(self, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions.rows(0, num_tokens),
            slot_mapping=self.slot_mapping.rows(0, num_tokens),
            query_start_loc=self.query_start_loc.rows(0, num_seqs + 1),
            seq_lens=self.seq_lens.rows(0, num_seqs),
            block_tables=self.block_tables.rows(0, num_seqs),
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )

    # -- sampling -------------------------------------------------------------------------
    def upload_sampling(self, packed: PackedSampling) -> SamplingTensors:
        """Copy packed sampling rows in (growing the variable-length arrays when needed)."""
        num_rows = packed.num_rows
        num_penalties, num_biases = packed.penalty_token_ids.shape[0], packed.bias_token_ids.shape[0]
        self._ensure_csr_capacity(num_penalties, num_biases)
        put = self._put
        return SamplingTensors(
            temperature=put(self.temperature, packed.temperature, num_rows),
            top_k=put(self.top_k, packed.top_k, num_rows),
            top_p=put(self.top_p, packed.top_p, num_rows),
            min_p=put(self.min_p, packed.min_p, num_rows),
            seeds=put(self.seeds, packed.seeds, num_rows),
            counters=put(self.counters, packed.counters, num_rows),
            repetition_penalty=put(self.repetition_penalty, packed.repetition_penalty, num_rows),
            presence_penalty=put(self.presence_penalty, packed.presence_penalty, num_rows),
            frequency_penalty=put(self.frequency_penalty, packed.frequency_penalty, num_rows),
            penalty_offsets=put(self.penalty_offsets, packed.penalty_offsets, num_rows + 1),
            penalty_token_ids=put(self.penalty_token_ids, packed.penalty_token_ids, num_penalties),
            penalty_output_counts=put(self.penalty_output_counts, packed.penalty_output_counts, num_penalties),
            bias_offsets=put(self.bias_offsets, packed.bias_offsets, num_rows + 1),
            bias_token_ids=put(self.bias_token_ids, packed.bias_token_ids, num_biases),
            bias_values=put(self.bias_values, packed.bias_values, num_biases),
            num_rows=num_rows,
            all_greedy=packed.all_greedy,
            any_penalties=packed.any_penalties,
            any_bias=packed.any_bias,
        )

    def top_logprob_views(self, num_rows: int, num_top: int) -> tuple[Tensor, Tensor]:
        """Dense [num_rows, num_top] views over the start of the [max_seqs, MAX_LOGPROBS] buffers."""
        return _leading_block(self.top_ids, num_rows, num_top), _leading_block(self.top_logprobs, num_rows, num_top)

    def _put(self, buffer: Tensor, values: np.ndarray, count: int) -> Tensor:
        view = buffer.rows(0, count)
        if count:
            self._backend.copy_from_host(view, values[:count])
        return view

    def _ensure_csr_capacity(self, num_penalties: int, num_biases: int) -> None:
        """Grow the variable-length arrays (sampling runs outside captured graphs)."""
        backend = self._backend
        if num_penalties > self.penalty_token_ids.shape[0]:
            size = 1 << (num_penalties - 1).bit_length()
            self.penalty_token_ids = backend.empty((size,), DType.I32)
            self.penalty_output_counts = backend.empty((size,), DType.I32)
        if num_biases > self.bias_token_ids.shape[0]:
            size = 1 << (num_biases - 1).bit_length()
            self.bias_token_ids = backend.empty((size,), DType.I32)
            self.bias_values = backend.empty((size,), DType.F32)


def _leading_block(buffer: Tensor, num_rows: int, num_columns: int) -> Tensor:
    total = buffer.shape[0] * buffer.shape[1]
    return buffer.view(total).rows(0, num_rows * num_columns).view(num_rows, num_columns)
