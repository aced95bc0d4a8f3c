"""Draft heads as models: the MTP layers of a checkpoint (and EAGLE-3 heads) run by a `Worker`.

A draft head is a `Model` like any other (its layers, its KV cache group, the generic loop),
whose first end reads, beside each token, a hidden state the proposer staged in a device buffer
(`HiddenInput`): the MTP head's first end is

    residual = fc_e(norm_e(embed(token))) + fc_h(norm_h(hidden))    (`fc` split by columns)

and its last the target's lm_head after the head's own final norm. `HeadWorker` is what the
proposer (`atlas.domain.speculative.draft_head`) runs it through: it uploads a step's hidden
states into the buffer, then runs the step on the head's worker, which keeps the head's last
layer output (the hidden state a next draft step is fed). The buffer is persistent, so a
captured decode graph of the head reads each step's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import msgspec
import numpy as np

from atlas.domain.batch import ScheduledBatch, StepResult
from atlas.domain.models.model import Model
from atlas.domain.models.qwen3_next import MtpModule
from atlas.domain.worker import Worker
from atlas.ports.gpu import GpuBackend, Tensor
from atlas.ports.kernels.dense import Projection, Vocab


@dataclass(frozen=True, slots=True)
class HiddenInput:
    """The hidden-state rows a head's step reads ([max_tokens, H] in the activation dtype), and a
    scratch of the same shape for the token embeddings."""

    hidden: Tensor
    embedded: Tensor

    @classmethod
    def allocate(cls, backend: GpuBackend, max_tokens: int, hidden_size: int) -> HiddenInput:
        dtype = backend.capabilities.activation_dtype
        return cls(backend.empty((max_tokens, hidden_size), dtype), backend.empty((max_tokens, hidden_size), dtype))


@dataclass(frozen=True, slots=True)
class MtpEnds:
    """The MTP head's two ends (`VocabEnds`): the token and hidden-state projections in, the
    target's lm_head after the head's norm out."""

    vocab: Vocab
    embedding_projection: Projection
    hidden_projection: Projection
    inputs: HiddenInput

    def embed(self, backend: GpuBackend, token_ids: Tensor, out: Tensor) -> None:
        num_tokens = token_ids.shape[0]
        embedded = self.inputs.embedded.rows(0, num_tokens)
        backend.dense.embed(token_ids, self.vocab, embedded)
        backend.dense.project(embedded, self.embedding_projection, out)
        backend.dense.project_add(self.inputs.hidden.rows(0, num_tokens), self.hidden_projection, out)

    def logits(self, backend: GpuBackend, hidden: Tensor, out: Tensor) -> None:
        backend.dense.logits(hidden, self.vocab, out)


def mtp_head(mtp: MtpModule, backend: GpuBackend, max_tokens: int, vocab_size: int) -> tuple[Model, HiddenInput]:
    """The MTP head as a model over its own cache groups, and the hidden-state buffer it reads
    (for steps of up to `max_tokens` tokens: the head worker's step size and largest graph)."""
    inputs = HiddenInput.allocate(backend, max_tokens, mtp.hidden_size)
    ends = MtpEnds(mtp.vocab, mtp.embedding_projection, mtp.hidden_projection, inputs)
    model = Model(backend, mtp.vocab, mtp.layers, mtp.cache_groups, mtp.hidden_size, vocab_size, ends=ends)
    return model, inputs


class HeadWorker:
    """Runs a draft head's steps (`atlas.domain.speculative.draft_head.HeadRunner`): stages the
    step's hidden states (fused by `fuse` first where the head takes several target layers),
    then runs the head's worker (configured to keep its last layer), and maps the sampled ids of
    a head with a vocabulary of its own to the target's (`target_ids`, and back for logit bias)."""

    def __init__(self, worker: Worker, hidden: Tensor, target_width: int, fuse: Projection | None = None,
                 target_ids: np.ndarray | None = None) -> None:
        """`hidden`: the [max_tokens, H] rows the head's first end reads; `target_width`: the
        width of the target's rows (H for MTP; fused to H by `fuse` otherwise). Raises
        ValueError for a worker that does not keep the head's last layer output."""
        if worker.config.keep_hidden_layers != (len(worker.model.layers) - 1,):
            raise ValueError("a draft head's worker keeps its last layer's output (keep_hidden_layers)")
        self.worker = worker
        self._hidden = hidden
        self._target_width = target_width
        self._fuse = fuse
        backend = worker.backend
        self._staging = None if fuse is None else backend.empty((hidden.shape[0], target_width),
                                                                 backend.capabilities.activation_dtype)
        self._target_ids = target_ids
        self._draft_ids = None if target_ids is None else {int(t): d for d, t in enumerate(target_ids.tolist())}

    @property
    def target_width(self) -> int:
        return self._target_width

    def execute(self, batch: ScheduledBatch, hidden_states: np.ndarray, from_target: bool) -> StepResult:
        """Raises ValueError for rows of another width or count than the batch's tokens."""
        width = self._target_width if from_target else self.worker.model.hidden_size
        num_tokens = batch.num_tokens
        if hidden_states.shape != (num_tokens, width):
            raise ValueError(f"hidden states {hidden_states.shape} for {num_tokens} tokens of width {width}")
        backend = self.worker.backend
        if from_target and self._staging is not None and self._fuse is not None:
            staged = self._staging.rows(0, num_tokens)
            backend.copy_from_host(staged, hidden_states)
            backend.dense.project(staged, self._fuse, self._hidden.rows(0, num_tokens))
        else:
            backend.copy_from_host(self._hidden.rows(0, num_tokens), hidden_states)
        if self._target_ids is None:
            return self.worker.execute(batch)
        result = self.worker.execute(self._in_draft_ids(batch))
        token_ids = tuple(int(self._target_ids[token_id]) for token_id in result.token_ids)
        return StepResult(result.step_id, token_ids, result.logprobs, result.hidden_states)

    def _in_draft_ids(self, batch: ScheduledBatch) -> ScheduledBatch:
        """`batch` with each logit bias on draft ids (a target id the head cannot draft is dropped)."""
        draft_ids = self._draft_ids or {}
        sequences = []
        for seq in batch.sequences:
            sampling = seq.sampling
            if sampling is not None and sampling.bias_token_ids:
                kept = [(draft_ids[i], v) for i, v in zip(sampling.bias_token_ids, sampling.bias_values, strict=True)
                        if i in draft_ids]
                ids, values = (tuple(part) for part in zip(*kept, strict=True)) if kept else ((), ())
                seq = msgspec.structs.replace(seq, sampling=msgspec.structs.replace(
                    sampling, bias_token_ids=ids, bias_values=values))
            sequences.append(seq)
        return replace(batch, sequences=tuple(sequences))
