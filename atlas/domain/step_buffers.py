"""The persistent device buffers a step reads, filled by one copy instead of many.

Buffers are sized for the largest step; a step uses their leading rows, so a captured graph
replays over the same addresses with new contents. Every per-step value lives in one int32
arena, laid out so that one copy of a prefix refreshes all of it:

    int32 arena: | sampled ids [S] | host tokens [T] | token gather [T] | positions [T] |
                 | slot mapping [G, T] | query start [S+1] | seq lens [S] | shared prefix [G, S+2] |
                 | sample rows [S] |
                 | state slots [R, S] | chunk query start [S+1] | chunk seq lens [S] |
                 | snapshot slots [R, S, W] | top-k [S] | penalty offsets [S+1] | bias offsets [S+1] |
                 | f32 params [6, S] | (pad) | i64 params [2, S] (two words each) |
                 | block tables [S, G, W] + (G - 1) W |
                 ^ written by `sample` on the device; the host copy starts after it

A constrained step's allowed-token masks go to their own buffer [S, W] (W = ceil(V / 32)
words a row) by one more copy, made when the host has filled them (`stage_mask`); steps
without masks never touch it.

A model with G KV cache groups (R recurrent ones) has a slot mapping and a block table per KV
group (a state slot per recurrent group). A step verifying drafts of a model with recurrent
groups gives them their own sequences (`StateChunks`: chunk query start, chunk seq lens, the
state slots region holding the chunks' slots, W snapshot slots a chunk); those regions are
empty for a model without recurrent groups or speculation. The block tables interleave by sequence, so the copy
still ends at the last sequence's row: KV group g's table is the [S, G * W] view that starts g *
W words in, whose row s begins with sequence s's W entries of group g (the rest of a row is
other groups' entries, which attention never reads; the (G - 1) W words of padding keep the last
group's view inside the arena):

    G = 2:  | s0 g0 | s0 g1 | s1 g0 | s1 g1 | ... | pad |
            '--- row 0 of g0 ----'
                    '--- row 0 of g1 ----'

Token ids are gathered on the device, `token_ids[i] = arena[token_gather[i]]`: a placeholder
token reads the previous step's sample (rows [0, S)), every other token its host copy. The
float sampling parameters (temperature, top-p, min-p, the three penalties) and the 64-bit ones
(seeds, counters) are the same words read through `bitcast` views; the i64 rows start on an even
word (8-byte aligned, as the arena's base is), after a pad word where needed. They precede the
block tables because the copy ends at the last table row in use.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from atlas.domain.requests import MAX_LOGPROBS
from atlas.domain.sampling import PackedSampling
from atlas.domain.step_inputs import CacheLayout, HostStepInputs
from atlas.domain.token_mask import ALL_ALLOWED
from atlas.ports.gpu import Device, DType, Tensor, leading_block
from atlas.ports.kernels.attention import AttentionMetadata
from atlas.ports.kernels.recurrent import RecurrentMetadata
from atlas.ports.kernels.sampling import SamplingTensors

_INITIAL_CSR_CAPACITY = 1024
_NUM_F32_FIELDS = 6  # temperature, top_p, min_p, repetition, presence and frequency penalties
_NUM_I64_FIELDS = 2  # seeds, counters


class _Layout:
    """Offsets of the int32 arena's regions, in words (see the module docstring)."""

    def __init__(self, max_tokens: int, max_seqs: int, layout: CacheLayout) -> None:
        num_kv, table_width = layout.num_kv_groups, layout.table_width
        chunked = layout.num_state_groups > 0 and layout.snapshot_width > 0  # may verify drafts
        sizes = [
            ("sampled_ids", max_seqs),
            ("host_tokens", max_tokens),
            ("token_gather", max_tokens),
            ("positions", max_tokens),
            ("slot_mapping", num_kv * max_tokens),
            ("query_start_loc", max_seqs + 1),
            ("seq_lens", max_seqs),
            ("shared_prefix", num_kv * (max_seqs + 2)),
            ("sample_indices", max_seqs),
            ("state_slots", layout.num_state_groups * max_seqs),
            ("chunk_query_start_loc", max_seqs + 1 if chunked else 0),
            ("chunk_seq_lens", max_seqs if chunked else 0),
            ("snapshot_slots", layout.num_state_groups * max_seqs * layout.snapshot_width),
            ("top_k", max_seqs),
            ("penalty_offsets", max_seqs + 1),
            ("bias_offsets", max_seqs + 1),
            ("sampling_f32", _NUM_F32_FIELDS * max_seqs),
            ("sampling_i64", 2 * _NUM_I64_FIELDS * max_seqs),
            ("block_tables", (max_seqs * num_kv + num_kv - 1) * table_width),
        ]
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, size in sizes:
            if name == "sampling_i64":
                offset += offset % 2  # the pad word: int64 values need 8-byte alignment
            self.offsets[name] = offset
            offset += size
        self.total = offset
        self.row_width = num_kv * table_width  # words of one sequence's tables
        # build_step_inputs addresses host tokens as rows max_seqs.. of the arena
        assert self.offsets["sampled_ids"] == 0 and self.offsets["host_tokens"] == max_seqs

    def region(self, name: str, length: int) -> slice:
        start = self.offsets[name]
        return slice(start, start + length)


class StepBuffers:
    """Device buffers for steps of up to `max_tokens` tokens and `max_seqs` sequences (and
    sampling rows), with allowed-token masks of `mask_words` words a row (0: no mask buffer)."""

    def __init__(self, backend: Device, max_tokens: int, max_seqs: int, caches: CacheLayout,
                 mask_words: int = 0) -> None:
        """Buffers for steps of a model whose caches the worker addresses as `caches` says."""
        self._backend = backend
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        layout = _Layout(max_tokens, max_seqs, caches)
        self._layout = layout
        self._arena = backend.empty((layout.total,), DType.I32)
        # The arena's host side, twice (page-locked where the backend has it; `send` is one copy
        # with no staging of its own): a step stages into one side while the copy of the step
        # before it may not have run yet, and waits for its side's last copy before writing.
        self._sides = (backend.host_mirror(self._arena), backend.host_mirror(self._arena))
        self._side = 0
        self._side_ready = False  # the current side's last copy was waited for
        self._num_table_rows = 0

        num_f32_words, num_i64_words = _NUM_F32_FIELDS * max_seqs, 2 * _NUM_I64_FIELDS * max_seqs
        f32_region = layout.region("sampling_f32", num_f32_words)
        i64_region = layout.region("sampling_i64", num_i64_words)
        # each side's sampling fields, as views: staged into its arena
        self._side_f32 = [side.array[f32_region].view(np.float32).reshape(_NUM_F32_FIELDS, max_seqs)
                          for side in self._sides]
        self._side_i64 = [side.array[i64_region].view(np.int64).reshape(_NUM_I64_FIELDS, max_seqs)
                          for side in self._sides]
        f32 = self._region("sampling_f32", num_f32_words).bitcast(DType.F32)
        i64 = self._region("sampling_i64", num_i64_words).bitcast(DType.I64)
        self._f32_fields = [f32.rows(i * max_seqs, (i + 1) * max_seqs) for i in range(_NUM_F32_FIELDS)]
        self._i64_fields = [i64.rows(i * max_seqs, (i + 1) * max_seqs) for i in range(_NUM_I64_FIELDS)]

        self.sampled_ids = self._region("sampled_ids", max_seqs)
        self.token_gather = self._region("token_gather", max_tokens)
        self.positions = self._region("positions", max_tokens)
        self.query_start_loc = self._region("query_start_loc", max_seqs + 1)
        self.seq_lens = self._region("seq_lens", max_seqs)
        self.sample_indices = self._region("sample_indices", max_seqs)
        row = layout.row_width
        self.slot_mappings = [self._part("slot_mapping", g * max_tokens, max_tokens) for g in range(caches.num_kv_groups)]
        self.shared_prefixes = [
            self._part("shared_prefix", g * (max_seqs + 2), max_seqs + 2) for g in range(caches.num_kv_groups)
        ]
        self.state_slots = [self._part("state_slots", g * max_seqs, max_seqs) for g in range(caches.num_state_groups)]
        self._snapshot_width = width = caches.snapshot_width
        self.snapshot_slots = [  # [S, W] each
            self._part("snapshot_slots", g * max_seqs * width, max_seqs * width).view(max_seqs, width)
            for g in range(caches.num_state_groups if width else 0)
        ]
        self.block_tables = [  # [S, G * W]: group g's W entries first in each row
            self._part("block_tables", g * caches.table_width, max_seqs * row).view(max_seqs, row)
            for g in range(caches.num_kv_groups)
        ]
        self.token_ids = backend.empty((max_tokens,), DType.I32)
        self.sampled_logprobs = backend.empty((max_seqs,), DType.F32)
        self.top_ids = backend.empty((max_seqs, MAX_LOGPROBS), DType.I32)
        self.top_logprobs = backend.empty((max_seqs, MAX_LOGPROBS), DType.F32)
        self.penalty_token_ids = backend.empty((_INITIAL_CSR_CAPACITY,), DType.I32)
        self.penalty_output_counts = backend.empty((_INITIAL_CSR_CAPACITY,), DType.I32)
        self.bias_token_ids = backend.empty((_INITIAL_CSR_CAPACITY,), DType.I32)
        self.bias_values = backend.empty((_INITIAL_CSR_CAPACITY,), DType.F32)
        # Every row starts all allowed, so a graph's padding rows read a valid mask.
        all_allowed = np.full((max_seqs, mask_words), ALL_ALLOWED, np.int32)
        self.token_mask = backend.upload(all_allowed) if mask_words else None
        # the masks' host side: `stage_mask` writes it, `upload_mask` (inside a masked sampler's
        # graph) copies it up with no staging of its own
        self._mask_mirror = backend.host_mirror(self.token_mask) if self.token_mask is not None else None

    def _host_arena(self) -> np.ndarray:
        """The side of the host arena this step stages into, once that side's last copy has run."""
        side = self._sides[self._side]
        if not self._side_ready:
            side.wait_uploaded()
            self._side_ready = True
        return side.array

    def _region(self, name: str, length: int) -> Tensor:
        return self._part(name, 0, length)

    def _part(self, name: str, offset: int, length: int) -> Tensor:
        """`length` words of region `name` from `offset` words into it."""
        start = self._layout.offsets[name] + offset
        return self._arena.rows(start, start + length)

    # -- step inputs ----------------------------------------------------------------------
    def stage_inputs(self, inputs: HostStepInputs) -> None:
        """Write a step's arrays into the host arena (sent by `send`)."""
        host, layout = self._host_arena(), self._layout
        num_tokens, num_seqs, num_rows = inputs.num_tokens, inputs.num_seqs, inputs.num_sample_rows
        host[layout.region("host_tokens", num_tokens)] = inputs.token_ids
        host[layout.region("token_gather", num_tokens)] = inputs.token_gather  # rows of this arena
        host[layout.region("positions", num_tokens)] = inputs.positions
        slots_at, tokens = layout.offsets["slot_mapping"], self.max_tokens
        for group, slots in enumerate(inputs.slot_mapping):
            host[slots_at + group * tokens : slots_at + group * tokens + num_tokens] = slots
        host[layout.region("query_start_loc", num_seqs + 1)] = inputs.query_start_loc
        host[layout.region("seq_lens", num_seqs)] = inputs.seq_lens
        shared_at, width = layout.offsets["shared_prefix"], self.max_seqs + 2
        for group in range(len(self.shared_prefixes)):
            start = shared_at + group * width
            if inputs.shared_prefix is None:
                host[start] = 0  # no prefix: the kernels read no more of the group's words
            else:
                host[start : start + num_seqs + 2] = inputs.shared_prefix[group]
        host[layout.region("sample_indices", num_rows)] = inputs.sample_indices
        chunks = inputs.chunks
        state_slots, num_state_seqs = (inputs.state_slots, num_seqs) if chunks is None else (
            chunks.state_slots, chunks.num_seqs)
        states_at = layout.offsets["state_slots"]
        for group, slots in enumerate(state_slots):
            host[states_at + group * self.max_seqs : states_at + group * self.max_seqs + num_state_seqs] = slots
        if chunks is not None:
            host[layout.region("chunk_query_start_loc", num_state_seqs + 1)] = chunks.query_start_loc
            host[layout.region("chunk_seq_lens", num_state_seqs)] = chunks.seq_lens
            words, snapshots_at = num_state_seqs * self._snapshot_width, layout.offsets["snapshot_slots"]
            for group, slots in enumerate(chunks.snapshot_slots):
                start = snapshots_at + group * self.max_seqs * self._snapshot_width
                host[start : start + words] = slots.reshape(-1)
        host[layout.region("block_tables", num_seqs * layout.row_width)] = inputs.block_tables.reshape(-1)
        self._num_table_rows = num_seqs

    def send(self) -> None:
        """Copy what was staged, in one copy: the host arena from past the sampled ids through
        the block tables in use (step inputs and sampling parameters ride together). Ordered
        with the ops on the stream."""
        layout = self._layout
        start = layout.offsets["host_tokens"]
        stop = layout.offsets["block_tables"] + self._num_table_rows * layout.row_width
        self._sides[self._side].upload(start, stop)
        self._side, self._side_ready = 1 - self._side, False

    def gather_tokens(self, num_tokens: int) -> None:
        """token_ids[:n] = arena[token_gather[:n]] (enqueued; capturable)."""
        self._backend.gather_rows(
            self._arena.view(self._layout.total, 1),
            self.token_gather.rows(0, num_tokens),
            self.token_ids.rows(0, num_tokens).view(num_tokens, 1),
        )

    def metadata(
        self, kv_group: int, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int,
        shared_prefix_len: int = 0,
    ) -> AttentionMetadata:
        """The step's view for KV group `kv_group` (its index among the KV groups);
        `shared_prefix_len` > 0: its decode rows share a prefix of at least that many tokens
        (`AttentionMetadata.shared_prefix`)."""
        return AttentionMetadata(
            positions=self.positions.rows(0, num_tokens),
            slot_mapping=self.slot_mappings[kv_group].rows(0, num_tokens),
            query_start_loc=self.query_start_loc.rows(0, num_seqs + 1),
            seq_lens=self.seq_lens.rows(0, num_seqs),
            block_tables=self.block_tables[kv_group].rows(0, num_seqs),
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            shared_prefix=self.shared_prefixes[kv_group].rows(0, num_seqs + 2) if shared_prefix_len else None,
            shared_prefix_len=shared_prefix_len,
        )

    def recurrent_metadata(
        self, state_group: int, num_tokens: int, num_seqs: int, max_query_len: int
    ) -> RecurrentMetadata:
        """The step's view for recurrent group `state_group` (its index among the state groups)."""
        return RecurrentMetadata(
            query_start_loc=self.query_start_loc.rows(0, num_seqs + 1),
            seq_lens=self.seq_lens.rows(0, num_seqs),
            state_slots=self.state_slots[state_group].rows(0, num_seqs),
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=max_query_len,
        )

    def chunk_metadata(self, state_group: int, num_tokens: int, num_seqs: int, max_query_len: int) -> RecurrentMetadata:
        """The view of recurrent group `state_group` in a step staged with `StateChunks` of
        `num_seqs` chunks: their own sequences and snapshot slots."""
        return RecurrentMetadata(
            query_start_loc=self._region("chunk_query_start_loc", num_seqs + 1),
            seq_lens=self._region("chunk_seq_lens", num_seqs),
            state_slots=self.state_slots[state_group].rows(0, num_seqs),
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=max_query_len,
            snapshot_slots=self.snapshot_slots[state_group].rows(0, num_seqs),
        )

    # -- sampling -------------------------------------------------------------------------
    def stage_sampling(self, packed: PackedSampling) -> None:
        """Write a step's sampling rows into the host arena (sent by `send`)."""
        num_rows = packed.num_rows
        layout, host = self._layout, self._host_arena()
        host_f32, host_i64 = self._side_f32[self._side], self._side_i64[self._side]
        host[layout.region("top_k", num_rows)] = packed.top_k[:num_rows]
        host[layout.region("penalty_offsets", num_rows + 1)] = packed.penalty_offsets[: num_rows + 1]
        host[layout.region("bias_offsets", num_rows + 1)] = packed.bias_offsets[: num_rows + 1]
        f32_values = (
            packed.temperature,
            packed.top_p,
            packed.min_p,
            packed.repetition_penalty,
            packed.presence_penalty,
            packed.frequency_penalty,
        )
        for index, values in enumerate(f32_values):
            host_f32[index, :num_rows] = values[:num_rows]
        host_i64[0, :num_rows] = packed.seeds[:num_rows]
        host_i64[1, :num_rows] = packed.counters[:num_rows]

    def stage_mask(self, bitmask: np.ndarray, num_rows: int) -> None:
        """Write a step's masks (int32 [R, W], one row per sampling row) into the masks' host
        side, and all-allowed rows for R..num_rows (a graph's padding rows), once the last
        upload of that side has run; `upload_mask` copies them up. Raises ValueError without a
        mask buffer or for a mask of the wrong width or too many rows."""
        mirror = self._mask_mirror
        num_real = bitmask.shape[0]
        if mirror is None or bitmask.ndim != 2 or bitmask.shape[1] != mirror.array.shape[1]:
            width = "no mask buffer" if mirror is None else f"[R, {mirror.array.shape[1]}]"
            raise ValueError(f"bitmask: expected int32 {width}, got {list(bitmask.shape)}")
        if not num_real <= num_rows <= self.max_seqs:
            raise ValueError(f"bitmask: {num_real} rows padded to {num_rows}, at most {self.max_seqs}")
        host = mirror.array
        # filled in place (`mask_rows`, which waited for the last upload before the fill wrote)
        # or copied in once the step before's sampler has read them (its ids are back: at once)
        if not (num_real and bitmask.ctypes.data == host.ctypes.data):
            mirror.wait_uploaded()
            host[:num_real] = bitmask
        if num_rows > num_real:
            host[num_real:num_rows] = ALL_ALLOWED

    def mask_rows(self) -> np.ndarray | None:
        """The masks' host side (int32 [max_seqs, W]) for a step's masks to be filled in
        place, once the last upload from it has run; `stage_mask` of its leading rows then
        copies nothing. None without a mask buffer."""
        mirror = self._mask_mirror
        if mirror is None:
            return None
        mirror.wait_uploaded()
        return mirror.array

    def upload_mask(self, num_rows: int) -> None:
        """Enqueue the copy of the staged masks' first `num_rows` rows into the mask buffer
        (capturable: a masked sampler's graph holds it). Ordered on the stream: the sampler
        enqueued next reads them."""
        assert self._mask_mirror is not None
        self._mask_mirror.upload(0, num_rows)

    def graph_sampling_tensors(self, num_rows: int, masked: bool = False) -> SamplingTensors:
        """Views of the first `num_rows` sampling rows for a sampler that a graph bakes in:
        temperature (0 keeps a row greedy), top-k, top-p, min-p, the random stream and, when
        `masked`, the mask buffer's rows. Penalties and bias are off, so the empty penalty and
        bias arrays are never read; steps that need them sample with `sampling_tensors`."""
        temperature, top_p, min_p, repetition, presence, frequency = (
            field.rows(0, num_rows) for field in self._f32_fields
        )
        seeds, counters = (field.rows(0, num_rows) for field in self._i64_fields)
        return SamplingTensors(
            temperature=temperature,
            top_k=self._region("top_k", num_rows),
            top_p=top_p,
            min_p=min_p,
            seeds=seeds,
            counters=counters,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            penalty_offsets=self._region("penalty_offsets", num_rows + 1),
            penalty_token_ids=self.penalty_token_ids.rows(0, 0),
            penalty_output_counts=self.penalty_output_counts.rows(0, 0),
            bias_offsets=self._region("bias_offsets", num_rows + 1),
            bias_token_ids=self.bias_token_ids.rows(0, 0),
            bias_values=self.bias_values.rows(0, 0),
            num_rows=num_rows,
            all_greedy=False,
            any_penalties=False,
            any_bias=False,
            token_mask=self.token_mask.rows(0, num_rows) if masked and self.token_mask is not None else None,
        )

    def sampling_tensors(self, packed: PackedSampling, masked: bool = False) -> SamplingTensors:
        """Views of the sent sampling rows, with the variable-length penalty and bias arrays
        copied in (only steps that have them pay for those copies); `masked`: the staged masks."""
        num_penalties, num_biases = packed.penalty_token_ids.shape[0], packed.bias_token_ids.shape[0]
        self._ensure_csr_capacity(num_penalties, num_biases)
        return replace(
            self.graph_sampling_tensors(packed.num_rows, masked),
            penalty_token_ids=self._put(self.penalty_token_ids, packed.penalty_token_ids, num_penalties),
            penalty_output_counts=self._put(self.penalty_output_counts, packed.penalty_output_counts, num_penalties),
            bias_token_ids=self._put(self.bias_token_ids, packed.bias_token_ids, num_biases),
            bias_values=self._put(self.bias_values, packed.bias_values, num_biases),
            all_greedy=packed.all_greedy,
            any_penalties=packed.any_penalties,
            any_bias=packed.any_bias,
        )

    def top_logprob_views(self, num_rows: int, num_top: int) -> tuple[Tensor, Tensor]:
        """Dense [num_rows, num_top] views over the start of the [max_seqs, MAX_LOGPROBS] buffers."""
        return leading_block(self.top_ids, num_rows, num_top), leading_block(self.top_logprobs, num_rows, num_top)

    def _put(self, buffer: Tensor, values: np.ndarray, count: int) -> Tensor:
        view = buffer.rows(0, count)
        if count:
            self._backend.copy_from_host(view, values[:count])
        return view

    def _ensure_csr_capacity(self, num_penalties: int, num_biases: int) -> None:
        """Grow the variable-length arrays. A captured graph holds empty views of the old ones,
        which its sampler never reads (see `graph_sampling_tensors`)."""
        backend = self._backend
        if num_penalties > self.penalty_token_ids.shape[0]:
            size = 1 << (num_penalties - 1).bit_length()
            self.penalty_token_ids = backend.empty((size,), DType.I32)
            self.penalty_output_counts = backend.empty((size,), DType.I32)
        if num_biases > self.bias_token_ids.shape[0]:
            size = 1 << (num_biases - 1).bit_length()
            self.bias_token_ids = backend.empty((size,), DType.I32)
            self.bias_values = backend.empty((size,), DType.F32)

