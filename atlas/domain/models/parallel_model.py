"""One tensor-parallel rank's model: load the description, cut each layer, prepare the parts.

    described = load_model(config, DeferredWeights(weights), DescribingBackend(backend), ...)
    model = shard_model(described, backend, comm, placement, max_tokens, max_rows)

The family loader runs unchanged over the describing backend (`deferred_load.py`), so the
described model's layers hold host weights whose tensors are not read yet. `shard_model` walks
the layers by kind, cuts each kind's weights as `sharding.py` declares, prepares the rank's
part on the real backend and builds the kind's parallel form (`parallel_layers.py`); the
vocabulary becomes a `ParallelVocab`. Layer after layer, so a rank's host memory holds one
layer's part at a time and it reads 1/t of the checkpoint (plus what every rank keeps whole:
norms, routers, a replicated KV head).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from atlas.domain.models.cache_groups import CacheGroupSpec
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.deferred_load import DescribedAttention, DescribedDeltaNet, DescribingBackend
from atlas.domain.models.families import load_model
from atlas.domain.models.feed_forward import DenseFeedForward, MoeFeedForward
from atlas.domain.models.layers import FeedForward, Layer, Mixer
from atlas.domain.models.mixers import AttentionMixer, DeltaNetMixer
from atlas.domain.models.model import Model
from atlas.domain.models.parallel_layers import (
    ParallelAttentionMixer,
    ParallelDeltaNetMixer,
    ParallelDenseFeedForward,
    ParallelMoeFeedForward,
    PartialSums,
)
from atlas.domain.models.parallel_vocab import ParallelVocab
from atlas.domain.models.shard_reads import DeferredWeights
from atlas.domain.models.sharding import (
    ShardingError,
    attention_part,
    cache_shape_part,
    delta_net_part,
    gated_projection,
    moe_part,
    row_projection,
    vocab_part,
)
from atlas.domain.parallel import RankPlacement
from atlas.ports.comm import CommBackend
from atlas.ports.gpu import DType, GpuBackend
from atlas.ports.kernels.dense import HostProjection, HostVocab
from atlas.ports.kernels.moe import HostMoe
from atlas.ports.weights import WeightSource


class _Rank:
    """What every layer's cut needs: the backend, the placement and the partial-sum rule."""

    def __init__(self, backend: GpuBackend, comm: CommBackend, placement: RankPlacement) -> None:
        self.backend = backend
        self.placement = placement
        self.sums = PartialSums(comm, placement.carries_residual)


def shard_model(
    described: Model,
    backend: GpuBackend,
    comm: CommBackend,
    placement: RankPlacement,
    max_tokens: int,
    max_rows: int,
) -> Model:
    """The rank's model from a described one (see the module docstring), for steps of up to
    `max_tokens` tokens and `max_rows` sampled rows. Raises `ShardingError` for a layer kind or
    a weight layout that has no tensor-parallel form, before any weight is prepared where the
    kinds tell (every layer's kinds are checked first)."""
    for layer in described.layers:
        _mixer_cut(layer.mixer)
        _feed_forward_cut(layer.feed_forward)
    rank = _Rank(backend, comm, placement)
    layers = [
        Layer(_mixer_cut(layer.mixer)(layer.mixer, rank),
              _feed_forward_cut(layer.feed_forward)(layer.feed_forward, rank))
        for layer in described.layers
    ]
    groups = tuple(CacheGroupSpec(cache_shape_part(group.shape, placement), group.layers)
                   for group in described.cache_groups)
    host_vocab = described.vocab
    if not isinstance(host_vocab, HostVocab):
        raise ShardingError("the model was not loaded through a DescribingBackend")
    vocab = backend.dense.prepare_vocab(vocab_part(host_vocab, placement))
    ends = ParallelVocab(backend, vocab, described.vocab_size, placement, comm, max_tokens, max_rows)
    return Model(backend, vocab, layers, groups, described.hidden_size, described.vocab_size, ends)


def _attention(mixer: AttentionMixer, rank: _Rank) -> ParallelAttentionMixer:
    described = _described(mixer.attention, DescribedAttention)
    local, columns = attention_part(described, rank.placement)
    backend = rank.backend
    return ParallelAttentionMixer(
        spec=local.layer,
        group=mixer.group,
        attention=backend.attention.prepare(local.host, local.layer),
        output=backend.dense.prepare(row_projection(_described(mixer.output, HostProjection), columns, rank.placement)),
        sums=rank.sums,
        hidden_size=mixer.hidden_size,
    )


def _delta_net(mixer: DeltaNetMixer, rank: _Rank) -> ParallelDeltaNetMixer:
    described = _described(mixer.delta_net, DescribedDeltaNet)
    projection, local, columns = delta_net_part(_described(mixer.input, HostProjection), described, rank.placement)
    backend = rank.backend
    return ParallelDeltaNetMixer(
        spec=local.layer,
        group=mixer.group,
        input=backend.dense.prepare(projection),
        delta_net=backend.recurrent.prepare(local.host, local.layer),
        output=backend.dense.prepare(row_projection(_described(mixer.output, HostProjection), columns, rank.placement)),
        sums=rank.sums,
        hidden_size=mixer.hidden_size,
    )


def _dense(feed_forward: DenseFeedForward, rank: _Rank) -> ParallelDenseFeedForward:
    start, stop = rank.placement.split(feed_forward.intermediate_size)
    dense = rank.backend.dense
    down = row_projection(_described(feed_forward.down, HostProjection), (start, stop), rank.placement)
    return ParallelDenseFeedForward(
        gate_up=dense.prepare(gated_projection(_described(feed_forward.gate_up, HostProjection), (start, stop))),
        down=dense.prepare(down),
        sums=rank.sums,
        intermediate_size=stop - start,
        hidden_size=feed_forward.hidden_size,
    )


def _moe(feed_forward: MoeFeedForward, rank: _Rank) -> ParallelMoeFeedForward:
    local = moe_part(_described(feed_forward.moe, HostMoe), rank.placement)
    widths = [local.gate_up.out_features // 2]
    if local.shared is not None:
        widths.append(local.shared.gate_up.out_features // 2)
    return ParallelMoeFeedForward(
        moe=rank.backend.moe.prepare(local),
        sums=rank.sums,
        top_k=feed_forward.top_k,
        hidden_size=feed_forward.hidden_size,
        expert_intermediate_size=max(widths),
    )


_MIXERS: dict[type, Callable] = {AttentionMixer: _attention, DeltaNetMixer: _delta_net}
_FEED_FORWARDS: dict[type, Callable] = {DenseFeedForward: _dense, MoeFeedForward: _moe}


def _mixer_cut(mixer: Mixer) -> Callable[[Mixer, _Rank], Mixer]:
    cut = _MIXERS.get(type(mixer))
    if cut is None:
        raise ShardingError(f"the {type(mixer).__name__} mixer has no tensor-parallel form yet")
    return cut


def _feed_forward_cut(feed_forward: FeedForward) -> Callable[[FeedForward, _Rank], FeedForward]:
    cut = _FEED_FORWARDS.get(type(feed_forward))
    if cut is None:
        raise ShardingError(f"the {type(feed_forward).__name__} feed-forward has no tensor-parallel form yet")
    return cut


def _described(prepared: object, kind: type):
    if not isinstance(prepared, kind):
        raise ShardingError(
            f"expected the described {kind.__name__} of a DescribingBackend, got {type(prepared).__name__}"
        )
    return prepared


def load_rank_model(
    config: ModelConfig,
    weights: WeightSource,
    backend: GpuBackend,
    comm: CommBackend,
    placement: RankPlacement,
    max_positions: int,
    max_tokens: int,
    max_rows: int,
    progress: Callable[[int, int], None] | None = None,
) -> Model:
    """`load_model` for one rank: the family loader over deferred weights and a describing
    backend, then `shard_model`. Raises what `load_model` does, and `ShardingError`."""
    described = load_model(config, DeferredWeights(weights), DescribingBackend(backend), max_positions, progress)
    return shard_model(described, backend, comm, placement, max_tokens, max_rows)


class CollectiveOp(enum.Enum):
    ALL_REDUCE = "all_reduce"  # [rows, width] summed in place
    ALL_GATHER = "all_gather"  # each rank's [rows, width] into [t * rows, width]


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective of a step."""

    op: CollectiveOp
    rows: int
    width: int
    dtype: DType


def step_collectives(model: Model, num_tokens: int, num_rows: int) -> list[Collective]:
    """The collectives one step of `num_tokens` tokens and `num_rows` sampled rows makes on a
    rank's model, in order: the embedding's all-reduce, one all-reduce per mixer and per
    feed-forward, the logits' all-gather (what `atlas bench` times)."""
    ends = model.ends
    if not isinstance(ends, ParallelVocab):
        return []
    dtype = model.backend.capabilities.activation_dtype
    reduce = Collective(CollectiveOp.ALL_REDUCE, num_tokens, model.hidden_size, dtype)
    gather = Collective(CollectiveOp.ALL_GATHER, num_rows, ends.local_size, DType.F32)
    return [reduce] * (1 + 2 * len(model.layers)) + [gather]
