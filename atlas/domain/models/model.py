"""The one generic loop: embed -> each layer's mixer and feed-forward -> logits of the sampled rows.

A model is data (its vocabulary, a list of `Layer`s, its cache groups) built by a family loader,
plus this loop. Every member writes into a `Workspace` sized for the largest step, so a step of
N tokens uses the first N rows of each buffer and a captured graph can replay the same calls.

    residual = embed(ids)
    for layer in layers:
        layer.mixer.forward(step, residual)          # residual += mixer(residual)
        layer.feed_forward.forward(step, residual)   # residual += feed_forward(residual)
    logits = head(rmsnorm(residual[sample rows]))

How a backend fuses inside each member (CUDA's decode step is five kernels a layer: the q/k/v
GEMV with RoPE and the cache write, attention, o_proj adding into the residual, the gated
gate_up GEMV, down adding into the residual) is its business, behind the kinds of
`atlas.ports.kernels`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from atlas.domain.models.cache_groups import CacheGroupSpec
from atlas.domain.models.feed_forward import DenseFeedForward
from atlas.domain.models.layers import GroupMetadata, Layer, LayerStep, Workspace
from atlas.domain.models.mixers import AttentionMixer
from atlas.ports.gpu import DType, GpuBackend, Kind, PiecewiseGraph, Tensor
from atlas.ports.kernels.dense import Vocab

# Called after layer i with the residual stream [N, H] it left (a view the next layer
# overwrites: copy what you keep). `atlas doctor` reads every layer's hidden state through it.
LayerObserver = Callable[[int, Tensor], None]


@dataclass(frozen=True, slots=True)
class StepTensors:
    """The device inputs of one step (views of the runner's persistent buffers)."""

    token_ids: Tensor  # [N] i32
    metadata: tuple[GroupMetadata, ...]  # one per cache group, in `Model.cache_groups` order
    sample_indices: Tensor | None  # [R] i32: rows of the step whose next token is sampled; None: all, in order

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


class VocabEnds(Protocol):
    """The loop's two ends: token ids into the residual stream, and the logits of sampled rows."""

    def embed(self, backend: GpuBackend, token_ids: Tensor, out: Tensor) -> None:
        """out [N, H] = the embedding rows of token_ids [N] i32."""
        ...

    def logits(self, backend: GpuBackend, hidden: Tensor, out: Tensor) -> None:
        """out [R, V] f32 = the logits of hidden [R, H] (only read)."""
        ...


@dataclass(frozen=True, slots=True)
class DeviceVocab:
    """The vocabulary on one device: the dense kind's `embed` and `logits`."""

    vocab: Vocab

    def embed(self, backend: GpuBackend, token_ids: Tensor, out: Tensor) -> None:
        backend.dense.embed(token_ids, self.vocab, out)

    def logits(self, backend: GpuBackend, hidden: Tensor, out: Tensor) -> None:
        backend.dense.logits(hidden, self.vocab, out)


class Model:
    """A loaded model: its prepared weights on a backend and the forward loop over them.
    `ends` replaces the dense kind's vocabulary ends (a tensor-parallel rank's split vocabulary)."""

    def __init__(
        self,
        backend: GpuBackend,
        vocab: Vocab,
        layers: Sequence[Layer],
        cache_groups: Sequence[CacheGroupSpec],
        hidden_size: int,
        vocab_size: int,
        ends: VocabEnds | None = None,
    ) -> None:
        self.backend = backend
        self.vocab = vocab
        self.ends = ends if ends is not None else DeviceVocab(vocab)
        self.layers = tuple(layers)
        self.cache_groups = tuple(cache_groups)
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size

    @property
    def kinds(self) -> frozenset[Kind]:
        """The kernel kinds its layers call (the dense kind for the vocabulary besides)."""
        kinds = {Kind.DENSE}
        for layer in self.layers:
            kinds |= layer.mixer.kinds | layer.feed_forward.kinds
        return frozenset(kinds)

    def allocate_workspace(self, max_tokens: int, max_sample_rows: int) -> Workspace:
        backend = self.backend
        dtype = backend.capabilities.activation_dtype
        widths, top_k, _ = self._needs()
        routed = max_tokens * top_k
        return Workspace(
            max_tokens=max_tokens,
            max_sample_rows=max_sample_rows,
            residual=backend.empty((max_tokens, self.hidden_size), dtype),
            scratch=tuple(backend.empty((max_tokens * width,), dtype) for width in widths),
            expert_ids=backend.empty((routed,), DType.I32) if top_k else None,
            expert_weights=backend.empty((routed,), DType.F32) if top_k else None,
            sample_hidden=backend.empty((max_sample_rows, self.hidden_size), dtype),
            logits=backend.empty((max_sample_rows, self.vocab_size), DType.F32),
        )

    def workspace_bytes(self, max_tokens: int, max_sample_rows: int) -> int:
        """What `allocate_workspace` takes plus the intermediates a backend may keep beside it,
        for the startup memory check."""
        itemsize = self.backend.capabilities.activation_dtype.itemsize
        widths, top_k, intermediate = self._needs()
        per_token = (self.hidden_size + sum(widths) + intermediate) * itemsize + top_k * 8
        per_row = self.hidden_size * itemsize + self.vocab_size * 4
        return max_tokens * per_token + max_sample_rows * per_row

    def forward(
        self,
        step: StepTensors,
        caches: Sequence[object],
        workspace: Workspace,
        num_sample_rows: int,
        observer: LayerObserver | None = None,
        layers: PiecewiseGraph | None = None,
    ) -> Tensor:
        """Run every layer over the step's tokens; return logits [num_sample_rows, V] (a view).
        `caches`: one per cache group, in `cache_groups` order (as `step.metadata`); ValueError
        for another count. `observer` sees the residual stream after each layer. `layers`: the
        layers captured for the step's token count (`capture_layers`), replayed with the step's
        metadata in place of running them (then no observer)."""
        if len(caches) != len(self.cache_groups) or len(step.metadata) != len(self.cache_groups):
            raise ValueError(
                f"{len(caches)} caches and {len(step.metadata)} metadata for {len(self.cache_groups)} cache groups"
            )
        backend = self.backend
        num_tokens = step.num_tokens
        residual = workspace.residual.rows(0, num_tokens)
        self.ends.embed(backend, step.token_ids, residual)
        layer_step = LayerStep(backend, num_tokens, step.metadata, caches, workspace)
        if layers is None:
            for index, layer in enumerate(self.layers):
                layer.mixer.forward(layer_step, residual)
                layer.feed_forward.forward(layer_step, residual)
                if observer is not None:
                    observer(index, residual)
        elif observer is not None:
            raise ValueError("an observer sees the layers run, not a replay of their pieces")
        else:
            layers.replay(layer_step)
        logits = workspace.logits.rows(0, num_sample_rows)
        if step.sample_indices is None:  # a decode step samples every row: no gather
            sample_hidden = residual.rows(0, num_sample_rows)
        else:
            sample_hidden = workspace.sample_hidden.rows(0, num_sample_rows)
            backend.gather_rows(residual, step.sample_indices, sample_hidden)
        self.ends.logits(backend, sample_hidden, logits)
        return logits

    @property
    def has_pieces(self) -> bool:
        """Whether `capture_layers` applies: every layer is attention over a dense feed-forward,
        whose work besides attention depends on a step's token count alone."""
        return all(
            isinstance(layer.mixer, AttentionMixer) and isinstance(layer.feed_forward, DenseFeedForward)
            for layer in self.layers
        )

    def capture_layers(
        self, step: StepTensors, caches: Sequence[object], workspace: Workspace, whole: bool = False
    ) -> PiecewiseGraph:
        """Capture the layers over `step`'s tokens as pieces (`Device.capture_pieces`), cut at
        each attention (`LayerStep.eager`). A replay in `forward` then does what the layers do
        for any step of as many token rows (real tokens first, the rest padding that writes
        only scratch slots): the pieces run the projections, norms and feed-forwards over every
        row, and each attention runs eagerly between them, sized by the replayed step's metadata
        (its real tokens). `whole`: attention is captured too, launched for `step`'s metadata,
        so a replay serves only steps whose attention launches as `step`'s does (one sequence
        over a context of at most `Capabilities.whole_prompt_keys`, as `step`'s single sequence
        of its token count). ValueError unless `has_pieces`."""
        if not self.has_pieces:
            raise ValueError("only layers of attention over dense feed-forwards are captured in pieces")
        backend, num_tokens = self.backend, step.num_tokens
        residual = workspace.residual.rows(0, num_tokens)

        def run(cut: Callable[[Callable[[LayerStep], None]], None]) -> None:
            layer_step = LayerStep(backend, num_tokens, step.metadata, caches, workspace, None if whole else cut)
            for layer in self.layers:
                layer.mixer.forward(layer_step, residual)
                layer.feed_forward.forward(layer_step, residual)

        return backend.capture_pieces(run)

    def _needs(self) -> tuple[list[int], int, int]:
        """(scratch widths, routed experts per token, widest intermediate) over every layer."""
        widths: list[int] = []
        top_k = intermediate = 0
        for layer in self.layers:
            for part in (layer.mixer, layer.feed_forward):
                needs = part.needs
                for index, width in enumerate(needs.scratch):
                    if index == len(widths):
                        widths.append(width)
                    widths[index] = max(widths[index], width)
                top_k = max(top_k, needs.top_k)
                intermediate = max(intermediate, needs.intermediate)
        return widths, top_k, intermediate
