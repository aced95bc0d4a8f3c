"""The worker: runs a `ScheduledBatch` on a device and returns only the sampled ids.

`submit` enqueues a whole step — one copy into persistent buffers, the model (eagerly, or by
replaying the forward graph captured for the decode batch size), sampling (a sampler graph of
that size, or eagerly) and the start of the ids' download — and returns at once, so the engine
can schedule the next step while the device runs this one. `PendingStep.result()` waits for
the ids. The worker never calls back into the scheduler.

A step that no decode graph covers (prompt tokens in it) runs eagerly, Python launching every
kernel of every layer, unless it has at most `WorkerConfig.piece_max_tokens` tokens and the
backend has piecewise graphs: its token rows are then padded to the next of `piece_buckets`
and the layers replay the pieces captured for that count (`Model.capture_layers`), attention
launched between them for the step's own sequences. Such a step costs the host a graph launch
and an attention launch a layer instead of a dozen launches.

A step whose batch `awaits_masks` stops after the forward: its rows' allowed-token masks depend
on tokens the host is still committing, so the engine fills them while the device runs the
forward and hands them over with `PendingStep.sample(bitmask)`, which uploads them and
enqueues the sampling.

A sampler graph covers temperature, top-k, top-p, min-p, the seeded stream and (one graph per
bucket with, one without) the masks, read from the persistent mask buffer; a step that also
wants penalties, logit bias or logprobs samples eagerly instead.

A sequence verifying k speculative drafts runs as k + 1 single-token rows (`decode_rows`): the
attention kind treats each as a decode over its own context, and a step of such rows replays
the decode graphs of its row count (a verify step is a decode step of B x (k + 1) rows). A
model with recurrent groups cannot run those rows apart (a state follows token by token): its
recurrent groups see each verify chunk whole, continuing from its slot and writing snapshots
(`StateChunks`), and such a step runs eagerly.

A worker configured to keep layer outputs (`WorkerConfig.keep_hidden_layers`, what a draft head
such as MTP or EAGLE-3 is fed) copies, inside the forward (graphs included), the residual stream
after each of those layers into buffers of its own, and downloads the step's rows of them with
the sampled ids: `StepResult.hidden_states`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import msgspec
import numpy as np

from atlas.domain.batch import SamplingRow, ScheduledBatch, ScheduledSequence, StepResult, TokenLogprobs
from atlas.domain.device_caches import DeviceCache, scratch_page
from atlas.domain.models.cache_groups import kv_group_indices, state_group_indices
from atlas.domain.models.layers import GroupMetadata
from atlas.domain.models.model import LayerObserver, Model, StepTensors
from atlas.domain.sampling import PackedSampling, RowPacker
from atlas.domain.step_buffers import StepBuffers
from atlas.domain.step_inputs import (
    SHARED_PREFIX_MIN_ROWS,
    SHARED_PREFIX_MIN_TOKENS,
    CacheLayout,
    HostStepInputs,
    StateChunks,
    TableRows,
    build_step_inputs,
    pad_decode_inputs,
    pad_prefill_inputs,
    piece_buckets,
    state_chunks,
    warm_up_inputs,
)
from atlas.domain.token_mask import bitmask_width
from atlas.ports.gpu import DType, GpuBackend, Graph, PendingDownload, PiecewiseGraph, Tensor
from atlas.ports.kernels.sampling import LogprobsOut

# What a graph's padding rows sample with: greedy, no filters (their ids are never read).
_PADDING_ROW = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    max_num_tokens: int  # tokens in one step
    max_num_seqs: int  # sequences in one step
    max_model_len: int
    graph_batch_sizes: tuple[int, ...] = ()  # decode batch sizes to capture; empty: always eager
    # layers whose output (the residual stream after them, before the final norm for the last)
    # each step hands back in `StepResult.hidden_states`, side by side in this order
    keep_hidden_layers: tuple[int, ...] = ()
    max_draft_tokens: int = 0  # drafts a sequence may verify (the snapshot slots of recurrent groups)
    # steps of up to this many tokens that no decode graph covers replay their layers' pieces
    # (where the backend and the model have them); 0: such steps run eagerly
    piece_max_tokens: int = 0


_LogprobsDownloads = tuple[PendingDownload, PendingDownload | None, PendingDownload | None]
# Enqueues a step's sampling with the given masks (None: no row is constrained).
_Sampler = Callable[[np.ndarray | None], tuple[PendingDownload, _LogprobsDownloads | None]]


class PendingStep:
    """A submitted step; `result()` blocks until its sampled ids reach the host.

    A step submitted with `awaits_masks` samples only once `sample` is called.
    """

    def __init__(self, step_id: int, wanted_logprobs: list[int | None], sampler: _Sampler | None = None,
                 hidden: tuple[PendingDownload, ...] = ()) -> None:
        self._step_id = step_id
        self._wanted = wanted_logprobs
        self._sampler = sampler  # None once sampled (or for a step without sampling rows)
        self._hidden = hidden  # the kept layers' rows of the step, one download a layer
        self._token_ids: PendingDownload | None = None
        self._logprobs: _LogprobsDownloads | None = None
        self._result: StepResult | None = None

    @property
    def awaits_masks(self) -> bool:
        """Whether the step still waits for `sample`."""
        return self._sampler is not None

    def sample(self, bitmask: np.ndarray | None) -> None:
        """Upload the step's masks (int32 [R, ceil(V / 32)], a row per sampling row; None when
        no row is constrained) and enqueue its sampling. Raises RuntimeError when the step was
        sampled already."""
        if self._sampler is None:
            raise RuntimeError(f"step {self._step_id} has sampled already")
        sampler, self._sampler = self._sampler, None
        self._token_ids, self._logprobs = sampler(bitmask)

    def result(self) -> StepResult:
        if self._sampler is not None:
            raise RuntimeError(f"step {self._step_id} waits for its masks: call sample(bitmask) first")
        if self._result is None:
            token_ids = self._token_ids.wait() if self._token_ids is not None else np.zeros(0, np.int32)
            logprobs = self._collect_logprobs(token_ids) if self._logprobs is not None else None
            hidden = None
            if self._hidden:
                hidden = np.concatenate([download.wait().astype(np.float32) for download in self._hidden], axis=1)
            self._result = StepResult(self._step_id, tuple(token_ids.tolist()), logprobs, hidden)
        return self._result

    def _collect_logprobs(self, token_ids: np.ndarray) -> tuple[TokenLogprobs | None, ...]:
        sampled_download, top_ids_download, top_values_download = self._logprobs
        sampled = sampled_download.wait()
        top_ids = top_ids_download.wait() if top_ids_download is not None else None
        top_values = top_values_download.wait() if top_values_download is not None else None
        result: list[TokenLogprobs | None] = []
        for row, num_top in enumerate(self._wanted):
            if num_top is None:
                result.append(None)
                continue
            top: tuple[tuple[int, float], ...] = ()
            if num_top and top_ids is not None and top_values is not None:
                top = tuple((int(top_ids[row, k]), float(top_values[row, k])) for k in range(num_top))
            result.append(TokenLogprobs(int(token_ids[row]), float(sampled[row]), top))
        return tuple(result)


class Worker:
    """Executes steps of one model on one backend."""

    def __init__(
        self, backend: GpuBackend, model: Model, caches: tuple[DeviceCache, ...], config: WorkerConfig
    ) -> None:
        """`caches`: one per cache group of the model, in order, as `allocate_caches` makes
        them (each with its scratch page, where padded graph rows write). Raises ValueError for
        another count, or KV caches of different block sizes."""
        groups = model.cache_groups
        if len(caches) != len(groups):
            raise ValueError(f"{len(caches)} caches for the model's {len(groups)} cache groups")
        kv_groups, state_groups = kv_group_indices(groups), state_group_indices(groups)
        block_sizes = {caches[index].spec.block_size for index in kv_groups}
        if len(block_sizes) != 1:
            raise ValueError(f"the KV caches must share one block size (got {sorted(block_sizes)})")
        self.backend = backend
        self.model = model
        self.caches = tuple(caches)
        self.config = config
        self.block_size = block_sizes.pop()
        self.kv_dtype = caches[kv_groups[0]].spec.dtype  # every KV group's (the model's --kv-cache-dtype)
        self.cache_layout = CacheLayout(
            block_size=self.block_size,
            table_width=-(-config.max_model_len // self.block_size),
            kv_scratch_blocks=tuple(scratch_page(caches[index]) for index in kv_groups),
            state_scratch_slots=tuple(scratch_page(caches[index]) for index in state_groups),
            snapshot_width=config.max_draft_tokens if state_groups else 0,
            kv_token_bytes=tuple(
                caches[index].spec.bytes_per_block // (caches[index].spec.num_layers * self.block_size)
                for index in kv_groups
            ),
        )
        # each cache group's index among the KV groups, or among the recurrent ones
        self._group_index = tuple(
            (True, kv_groups.index(index)) if index in kv_groups else (False, state_groups.index(index))
            for index in range(len(groups))
        )
        max_graph = max(config.graph_batch_sizes, default=0)
        max_tokens = max(config.max_num_tokens, max_graph)
        max_seqs = max(config.max_num_seqs, max_graph)
        self.buffers = StepBuffers(backend, max_tokens, max_seqs, self.cache_layout, bitmask_width(model.vocab_size))
        lone = self.cache_layout.num_kv_groups == 1 and not self.cache_layout.num_state_groups
        # a lone full-attention group's tables, kept between steps (rewritten where they change)
        self._table_rows = TableRows(max_seqs, self.cache_layout) if lone else None
        self._packer = RowPacker()  # this step's sampling rows, from the last step's where only counters moved
        self.workspace = model.allocate_workspace(max_tokens, max_seqs)
        self.graph_batch_sizes = tuple(sorted(config.graph_batch_sizes)) if backend.capabilities.supports_graphs else ()
        self._graphs: dict[int, tuple[Graph, Tensor]] = {}  # bucket -> (forward graph, its logits)
        # the same for steps whose decode rows share a prefix (captured when first needed; the
        # logits are the same rows of the workspace, so the samplers serve both)
        self._shared_prefix_graphs: dict[int, tuple[Graph, Tensor]] = {}
        self._sampler_graphs: dict[tuple[int, bool], Graph] = {}  # (bucket, masked) -> sampler graph
        self._deferred: list[int] = []  # buckets left to `capture_next_graph`, smallest first
        # then their shared-prefix variants; until captured, such steps replay the plain graph
        self._deferred_shared: list[int] = []
        self._kept = _KeptLayers(backend, model, config.keep_hidden_layers, max_tokens)
        # The token counts whose steps replay the layers' pieces (`Model.capture_layers`),
        # captured on first use or, left to `capture_next_graph`, in idle time (such steps run
        # eagerly until then). None holds more tokens than a step can: its warm-up would not fit.
        piecewise = backend.capabilities.piecewise_graphs and model.has_pieces
        most = min(config.piece_max_tokens, max_tokens, max_seqs * config.max_model_len)
        self.piece_buckets = piece_buckets(most) if piecewise else ()
        self._pieces: dict[int, PiecewiseGraph] = {}
        self._deferred_pieces: list[int] = []
        # A lone sequence's prompt step over a short context replays its layers captured whole,
        # attention inside (`Capabilities.whole_prompt_keys`): a batch-1 prefill is then one
        # replay, not a launch of attention and a piece a layer (~2 ms of host work for
        # SmolLM2's 30 layers, against ~0.3 ms of device time).
        self._whole_keys = min(backend.capabilities.whole_prompt_keys, config.max_model_len) if piecewise else 0
        self._whole: dict[int, PiecewiseGraph] = {}
        self._deferred_whole: list[int] = []

    def mask_rows(self) -> np.ndarray | None:
        """Where a step's masks may be filled in place for `PendingStep.sample` (the masks'
        page-locked host side: no copy before their upload), or None (`StepBuffers.mask_rows`)."""
        return self.buffers.mask_rows()

    def submit(self, batch: ScheduledBatch, before_launch: Callable[[], None] | None = None) -> PendingStep:
        """Enqueue one step (its sampling too, unless `batch.awaits_masks`). `before_launch` is
        called once, after the step's inputs are built and staged on the host and before
        anything of the step is enqueued. Raises ValueError if the batch exceeds the
        configured sizes."""
        chunks = self._state_chunks(batch)
        batch = decode_rows(batch)
        rows = [seq.sampling for seq in batch.sequences if seq.sampling is not None]
        wanted = [row.num_logprobs for row in rows]
        if batch.is_empty:
            if before_launch is not None:
                before_launch()
            return PendingStep(batch.step_id, wanted)
        bucket = self._graph_bucket(batch) if chunks is None else None
        staged = self._pack(rows, bucket)
        logits = self._forward(batch, bucket, staged, self._kept.observer, chunks, before_launch)
        hidden = self._kept.begin_downloads(batch.num_tokens)
        if staged is None:
            return PendingStep(batch.step_id, wanted, hidden=hidden)
        pending = PendingStep(batch.step_id, wanted, partial(self._sample, logits, staged, bucket, wanted), hidden)
        if not batch.awaits_masks:
            pending.sample(None)
        return pending

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step to completion (a step that awaits masks samples without any)."""
        pending = self.submit(batch)
        if pending.awaits_masks:
            pending.sample(None)
        return pending.result()

    def compute_logits(self, batch: ScheduledBatch, observer: LayerObserver | None = None) -> np.ndarray:
        """Run one step and return the float32 logits [R, V] of its sampling rows, unsampled.
        With an `observer` the step runs eagerly and the observer sees each layer's residual
        stream (`Model.forward`)."""
        chunks = self._state_chunks(batch)
        batch = decode_rows(batch)
        rows = [seq.sampling for seq in batch.sequences if seq.sampling is not None]
        bucket = None if observer is not None or chunks is not None else self._graph_bucket(batch)
        logits = self._forward(batch, bucket, self._pack(rows, bucket), observer, chunks)
        return self.backend.begin_download(logits.rows(0, batch.num_sampled)).wait()

    def capture_graphs(self, up_to: int | None = None) -> None:
        """Capture decode graphs now (startup), instead of on first use: the forward and the
        unmasked sampler of each bucket (masked samplers are captured when first needed).

        `up_to` None: every bucket. Otherwise only the buckets of at most `up_to` sequences;
        the larger ones are *deferred*: steps of their size run eagerly until
        `capture_next_graph` (the server's idle time) captures them, so a server answers its
        first request sooner and no capture runs between two steps of live traffic.

        The variants for steps whose decode rows share a prefix (cascade attention) are
        captured on first use with `up_to` None; otherwise they are deferred after the
        buckets (those of at least SHARED_PREFIX_MIN_ROWS sequences: smaller steps never name
        a prefix), and such steps replay the plain graph until then."""
        for bucket in self.graph_batch_sizes:
            if up_to is not None and bucket > up_to:
                self._deferred.append(bucket)
                continue
            self._capture_bucket(bucket)
        if up_to is not None:
            self._deferred_shared = [size for size in self.graph_batch_sizes if size >= SHARED_PREFIX_MIN_ROWS]
            self._deferred_pieces = list(self.piece_buckets)
            self._deferred_whole = [size for size in self.piece_buckets if size <= self._whole_keys]

    @property
    def num_deferred_graphs(self) -> int:
        return len(self._deferred)

    @property
    def num_piece_graphs(self) -> int:
        """Token counts whose layers' pieces are captured."""
        return len(self._pieces)

    @property
    def num_whole_graphs(self) -> int:
        """Token counts whose layers are captured whole, for a lone sequence's prompt steps."""
        return len(self._whole)

    def capture_next_graph(self) -> bool:
        """Capture the smallest deferred bucket's graphs, then the shared-prefix variants, the
        layers' pieces and their whole forms; False when none is left. Call it only with no
        step in flight (the capture runs its forward on the step buffers)."""
        if self._deferred:
            self._capture_bucket(self._deferred.pop(0))
            return True
        if self._deferred_shared:
            bucket = self._deferred_shared[0]
            if bucket not in self._shared_prefix_graphs:
                self._capture(bucket, shared_prefix=True)
            self._deferred_shared.pop(0)
            return True
        for deferred, captured, whole in ((self._deferred_pieces, self._pieces, False),
                                          (self._deferred_whole, self._whole, True)):
            if deferred:
                if deferred[0] not in captured:
                    self._capture_pieces(deferred[0], whole)
                deferred.pop(0)
                return True
        return False

    def warm_up(self, key: str) -> tuple[int, ...]:
        """Run eager forwards of the step sizes whose first step may still make the backend
        prepare something slow (time GEMM algorithms: `Device.unprepared_token_counts`), so
        live traffic never waits for it; returns those sizes. `key` names the model's products
        (the backend remembers warm-ups under it across restarts). Call it with no step in
        flight.

        The sizes are 16, 32, .. tokens up to the most a step can hold: the worker's
        `max_num_tokens`, or fewer where its sequences are too few and short to fill that
        (`max_seqs` of `max_model_len`). They are the token buckets a backend tunes by, each
        forward sampling as many rows as a step can (the LM head's sizes). A restart whose
        backend recorded them all runs none.
        """
        max_tokens = min(self.config.max_num_tokens, self.buffers.max_seqs * self.config.max_model_len)
        buckets = (1 << exponent for exponent in range(4, max_tokens.bit_length() + 2))
        sizes = tuple(sorted({min(bucket, max_tokens) for bucket in buckets}))
        key = f"{key}/{self.buffers.max_seqs}"  # the LM head's sizes go up to it
        todo = self.backend.unprepared_token_counts(key, sizes)
        if not todo:
            return ()
        for num_tokens in todo:
            self._warm_up_forward(num_tokens)
        self.backend.record_prepared(key, todo)
        return todo

    def _warm_up_forward(self, num_tokens: int) -> None:
        buffers = self.buffers
        inputs = warm_up_inputs(num_tokens, self.cache_layout, buffers.max_seqs, self.config.max_model_len)
        buffers.stage_inputs(inputs)
        buffers.send()
        buffers.gather_tokens(num_tokens)
        self.model.forward(self._step_tensors(inputs), self.caches, self.workspace, inputs.num_sample_rows)
        self.backend.synchronize()

    def _capture_bucket(self, bucket: int) -> None:
        if bucket not in self._graphs:
            self._capture(bucket)
        if (bucket, False) not in self._sampler_graphs:
            self._capture_sampler(bucket, masked=False)

    def _forward(
        self,
        batch: ScheduledBatch,
        bucket: int | None,
        packed: PackedSampling | None,
        observer: LayerObserver | None = None,
        chunks: StateChunks | None = None,
        before_launch: Callable[[], None] | None = None,
    ) -> Tensor:
        if batch.num_tokens > self.config.max_num_tokens or len(batch.sequences) > self.config.max_num_seqs:
            raise ValueError(
                f"step of {batch.num_tokens} tokens / {len(batch.sequences)} sequences exceeds the worker's "
                f"{self.config.max_num_tokens} / {self.config.max_num_seqs}"
            )
        buffers = self.buffers
        inputs = build_step_inputs(batch, self.cache_layout, buffers.max_seqs, self._table_rows, bucket)
        if chunks is not None:
            inputs = replace(inputs, chunks=chunks)
        if bucket is not None:
            # a deferred shared-prefix variant: the plain graph (its kernels read no prefix)
            shared_prefix = inputs.shared_prefix is not None and bucket not in self._deferred_shared
            graph_and_logits = (self._shared_prefix_graphs if shared_prefix else self._graphs).get(bucket)
            if graph_and_logits is None:  # a capture runs forwards on the buffers the step in flight reads
                if before_launch is not None:
                    before_launch()
                    before_launch = None
                graph_and_logits = self._capture(bucket, shared_prefix)
            graph, logits = graph_and_logits
            inputs = pad_decode_inputs(inputs, bucket, self.cache_layout, buffers.max_seqs)
        pieces, step = None, None
        if bucket is None and observer is None and chunks is None:
            num_rows = self._piece_bucket(inputs.num_tokens)
            if num_rows is not None:
                whole = (inputs.num_seqs == 1 and inputs.max_query_len > 1 and num_rows not in self._deferred_whole
                         and max(num_rows, inputs.max_seq_len) <= self._whole_keys)
                pieces = (self._whole if whole else self._pieces).get(num_rows)
                if pieces is None:  # its warm-up forward runs on the buffers the step in flight reads
                    if before_launch is not None:
                        before_launch()
                        before_launch = None
                    pieces = self._capture_pieces(num_rows, whole)
                step = self._step_tensors(inputs)  # the sequences' own metadata, for attention
                step = replace(step, token_ids=buffers.token_ids.rows(0, num_rows))
                inputs = pad_prefill_inputs(inputs, num_rows, self.cache_layout, buffers.max_seqs)
        # staged on the host only: the step in flight may still sample (`before_launch`) first
        buffers.stage_inputs(inputs)
        if packed is not None:
            buffers.stage_sampling(packed)
        if before_launch is not None:
            before_launch()
        buffers.send()
        if bucket is not None:
            graph.replay()
            return logits
        buffers.gather_tokens(inputs.num_tokens)
        if step is None:
            step = self._step_tensors(inputs)
        return self.model.forward(step, self.caches, self.workspace, inputs.num_sample_rows, observer, pieces)

    def _piece_bucket(self, num_tokens: int) -> int | None:
        """The token count whose pieces a step of `num_tokens` replays (None: it runs eagerly)."""
        index = bisect.bisect_left(self.piece_buckets, num_tokens)
        if index == len(self.piece_buckets):
            return None
        num_rows = self.piece_buckets[index]
        return None if num_rows in self._deferred_pieces else num_rows

    def _capture_pieces(self, num_tokens: int, whole: bool = False) -> PiecewiseGraph:
        """Capture the layers' pieces for steps of `num_tokens` token rows, after a forward of
        that size on warm-up inputs (lazy compilation and workspaces settle first; it writes
        only the scratch pages). The capture itself runs nothing. `whole`: the layers with
        their attention, for one sequence's steps (captured over one sequence of `num_tokens`)."""
        buffers = self.buffers
        longest = num_tokens if whole else self.config.max_model_len
        inputs = warm_up_inputs(num_tokens, self.cache_layout, buffers.max_seqs, longest)
        buffers.stage_inputs(inputs)
        buffers.send()
        buffers.gather_tokens(num_tokens)
        step = self._step_tensors(inputs)
        self.model.forward(step, self.caches, self.workspace, inputs.num_sample_rows)
        pieces = self.model.capture_layers(step, self.caches, self.workspace, whole)
        (self._whole if whole else self._pieces)[num_tokens] = pieces
        return pieces

    def _state_chunks(self, batch: ScheduledBatch) -> StateChunks | None:
        """The recurrent groups' own view of a step that verifies drafts (None otherwise)."""
        if not self.cache_layout.num_state_groups or not any(seq.num_draft_tokens for seq in batch.sequences):
            return None
        return state_chunks(batch, self.cache_layout)

    def _step_tensors(self, inputs: HostStepInputs) -> StepTensors:
        buffers = self.buffers
        return StepTensors(
            token_ids=buffers.token_ids.rows(0, inputs.num_tokens),
            metadata=self._metadata(inputs.num_tokens, inputs.num_seqs, inputs.max_query_len, inputs.max_seq_len,
                                    inputs.chunks, inputs.shared_prefix_len),
            # sample rows are distinct and ascending, so as many as the tokens means all of them
            sample_indices=None
            if inputs.num_sample_rows == inputs.num_tokens
            else buffers.sample_indices.rows(0, inputs.num_sample_rows),
        )

    def _metadata(
        self,
        num_tokens: int,
        num_seqs: int,
        max_query_len: int,
        max_seq_len: int,
        chunks: StateChunks | None = None,
        shared_prefix_len: Callable[[int], int] = lambda group: 0,
    ) -> tuple[GroupMetadata, ...]:
        """Each cache group's view of the step's buffers (`chunks`: the recurrent groups' own,
        as staged; `shared_prefix_len(g)`: KV group g's shared prefix, 0 none)."""
        buffers = self.buffers

        def recurrent(index: int) -> GroupMetadata:
            if chunks is None:
                return buffers.recurrent_metadata(index, num_tokens, num_seqs, max_query_len)
            return buffers.chunk_metadata(index, num_tokens, chunks.num_seqs, chunks.max_query_len)

        return tuple(
            buffers.metadata(index, num_tokens, num_seqs, max_query_len, max_seq_len, shared_prefix_len(index))
            if is_kv
            else recurrent(index)
            for is_kv, index in self._group_index
        )

    def _graph_bucket(self, batch: ScheduledBatch) -> int | None:
        if not self.graph_batch_sizes:
            return None
        if any(seq.num_tokens != 1 or seq.sampling is None for seq in batch.sequences):
            return None
        index = bisect.bisect_left(self.graph_batch_sizes, len(batch.sequences))
        if index == len(self.graph_batch_sizes):
            return None
        bucket = self.graph_batch_sizes[index]
        return None if self._deferred and bucket in self._deferred else bucket

    def _capture(self, bucket: int, shared_prefix: bool = False) -> tuple[Graph, Tensor]:
        """Capture the decode forward for `bucket` sequences: token gather and model, on the
        buffers, into logits [bucket, V] (sampled by `_capture_sampler`'s graphs);
        `shared_prefix`: the variant for steps whose decode rows share a prefix (each KV group
        may read one; the graph reads its length and rows from the buffers).

        Captured with the longest context so the kernels it bakes in cover every step; the
        buffers' current contents only need to be valid (padding rows are).
        """
        buffers = self.buffers
        step = StepTensors(
            token_ids=buffers.token_ids.rows(0, bucket),
            metadata=self._metadata(
                bucket, bucket, 1, self.config.max_model_len, None,
                (lambda group: SHARED_PREFIX_MIN_TOKENS) if shared_prefix else (lambda group: 0),
            ),
            sample_indices=None,  # every row of a decode bucket is sampled, in order
        )
        # valid inputs for the warm-up run: every row a padding row in the scratch pages
        padding = pad_decode_inputs(HostStepInputs.empty(self.cache_layout), bucket, self.cache_layout, buffers.max_seqs)
        buffers.stage_inputs(padding)
        buffers.stage_sampling(self._pack([], bucket))
        buffers.send()
        outputs: list[Tensor] = []

        def run_forward() -> None:
            buffers.gather_tokens(bucket)
            outputs[:] = [self.model.forward(step, self.caches, self.workspace, bucket, self._kept.observer)]

        run_forward()  # warm up outside capture: lazy compilation and workspaces settle first
        graph = self.backend.capture(run_forward)
        graphs = self._shared_prefix_graphs if shared_prefix else self._graphs
        graphs[bucket] = (graph, outputs[0])
        return graphs[bucket]

    def _capture_sampler(self, bucket: int, masked: bool) -> Graph:
        """Capture the sampling of `bucket` rows of the bucket's logits (see
        `StepBuffers.graph_sampling_tensors`) into the sampled ids; `masked`: through the mask
        buffer's rows. Captured after the bucket's forward graph, whose logits it reads."""
        backend, buffers = self.backend, self.buffers
        _, logits = self._graphs.get(bucket) or self._capture(bucket)
        tensors = buffers.graph_sampling_tensors(bucket, masked)
        # Warm up into a throwaway tensor: a step in flight may have sampled ids the next step
        # still gathers.
        backend.sampling.sample(logits, tensors, backend.empty((bucket,), DType.I32))

        def sample() -> None:
            if masked:  # the step's masks go up inside the graph, from what stage_mask wrote
                buffers.upload_mask(bucket)
            backend.sampling.sample(logits, tensors, buffers.sampled_ids.rows(0, bucket))

        graph = backend.capture(sample)
        self._sampler_graphs[(bucket, masked)] = graph
        return graph

    def _pack(self, rows: list[SamplingRow], bucket: int | None) -> PackedSampling | None:
        """The step's sampling rows (None without any), padded with greedy rows to a graph's
        `bucket`: the graph samples every row, so padding rows need valid parameters too."""
        if bucket is not None:
            return self._packer.pack(rows + [_PADDING_ROW] * (bucket - len(rows)))
        return self._packer.pack(rows) if rows else None

    def _sample(
        self,
        logits: Tensor,
        staged: PackedSampling,
        bucket: int | None,
        wanted: list[int | None],
        bitmask: np.ndarray | None,
    ) -> tuple[PendingDownload, _LogprobsDownloads | None]:
        """Enqueue the sampling of a forwarded step (`staged`: its rows, padded to `bucket`
        for a graph) and start the downloads."""
        buffers, backend = self.buffers, self.backend
        num_rows = len(wanted)
        masked = bitmask is not None
        if masked:
            buffers.stage_mask(bitmask, staged.num_rows)
        if bucket is not None and not _needs_eager_sampling(staged, wanted):
            graph = self._sampler_graphs.get((bucket, masked)) or self._capture_sampler(bucket, masked)
            graph.replay()
            return backend.begin_download(buffers.sampled_ids.rows(0, num_rows)), None
        if masked:
            buffers.upload_mask(staged.num_rows)
        packed = msgspec.structs.replace(staged, num_rows=num_rows)  # without a graph's padding rows
        tensors = buffers.sampling_tensors(packed, masked)
        num_top = max((n for n in wanted if n is not None), default=None)
        logprobs_out = None
        if num_top is not None:
            top_ids, top_logprobs = buffers.top_logprob_views(num_rows, num_top)
            logprobs_out = LogprobsOut(buffers.sampled_logprobs.rows(0, num_rows), top_ids, top_logprobs, num_top)
        out_ids = buffers.sampled_ids.rows(0, num_rows)
        backend.sampling.sample(logits.rows(0, num_rows), tensors, out_ids, logprobs_out)
        ids_download = backend.begin_download(out_ids)
        if logprobs_out is None:
            return ids_download, None
        return ids_download, (
            backend.begin_download(logprobs_out.sampled),
            backend.begin_download(logprobs_out.top_ids) if num_top else None,
            backend.begin_download(logprobs_out.top_logprobs) if num_top else None,
        )


class _KeptLayers:
    """The outputs of the layers a worker keeps: a buffer [max_tokens, H] per layer, written by
    a row gather inside the forward (so a captured graph keeps them too) and downloaded per step."""

    def __init__(self, backend: GpuBackend, model: Model, layers: tuple[int, ...], max_tokens: int) -> None:
        """Raises ValueError for a layer the model does not have."""
        bad = [layer for layer in layers if not 0 <= layer < len(model.layers)]
        if bad:
            raise ValueError(f"keep_hidden_layers {bad}: the model has layers 0 .. {len(model.layers) - 1}")
        self._backend = backend
        self._slots: dict[int, list[int]] = {}  # a layer may be kept twice (EAGLE-3 of a shallow target)
        for slot, layer in enumerate(layers):
            self._slots.setdefault(layer, []).append(slot)
        dtype = backend.capabilities.activation_dtype
        self._buffers = tuple(backend.empty((max_tokens, model.hidden_size), dtype) for _ in layers)
        self._row_ids = backend.upload(np.arange(max_tokens, dtype=np.int32), DType.I32) if layers else None

    @property
    def observer(self) -> LayerObserver | None:
        """What `Model.forward` calls after each layer (None: nothing is kept)."""
        return self._keep if self._slots else None

    def begin_downloads(self, num_tokens: int) -> tuple[PendingDownload, ...]:
        """Start downloading the step's `num_tokens` rows of each kept layer."""
        return tuple(self._backend.begin_download(buffer.rows(0, num_tokens)) for buffer in self._buffers)

    def _keep(self, index: int, residual: Tensor) -> None:
        if self._row_ids is None:
            return
        num_tokens = residual.shape[0]
        row_ids = self._row_ids.rows(0, num_tokens)
        for slot in self._slots.get(index, ()):
            self._backend.gather_rows(residual, row_ids, self._buffers[slot].rows(0, num_tokens))


def decode_rows(batch: ScheduledBatch) -> ScheduledBatch:
    """`batch` with each sequence that verifies drafts split into single-token rows.

        verify chunk   tokens  t  d0 d1 d2   at positions P .. P+3, rows r0 .. r3
        as rows        (t) at P  (d0) at P+1  (d1) at P+2  (d2) at P+3, each sampling its row

    Every row shares the sequence's block tables and attends up to its own position; the layer
    writes all four positions' K/V before any row attends, so row j sees d0 .. d(j-1) as the
    chunk's causal attention would. Sequences without drafts stay as they are.
    """
    if not any(seq.num_draft_tokens for seq in batch.sequences):
        return batch
    sequences: list[ScheduledSequence] = []
    for seq in batch.sequences:
        if not seq.num_draft_tokens:
            sequences.append(seq)
            continue
        sampling_rows = seq.sampling_rows
        first = seq.num_tokens - len(sampling_rows)  # tokens before the last one and the drafts
        if first:
            sequences.append(msgspec.structs.replace(seq, token_ids=seq.token_ids[:first], sampling=None,
                                                    num_draft_tokens=0, draft_rows=()))
        sequences.extend(seq.decode_row(first + offset, row) for offset, row in enumerate(sampling_rows))
    return replace(batch, sequences=tuple(sequences))


def _needs_eager_sampling(packed: PackedSampling, wanted: list[int | None]) -> bool:
    """Whether a step asks for more than a sampler graph does (penalties, bias, logprobs)."""
    return packed.any_penalties or packed.any_bias or any(num is not None for num in wanted)
