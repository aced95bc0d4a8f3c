"""How each layer kind's weights split over tensor-parallel ranks: one rank's part of each.

    attention        q|gate|k|v rows of the rank's query heads and KV heads (column-parallel;
                     a KV head replicated where there are fewer KV heads than ranks), sinks of
                     its heads; o_proj's matching columns (row-parallel)
    dense GLU        gate and up rows of the rank's 1/t of the width; down's matching columns
    MoE              the rank's experts (expert parallelism) and of each its part of the width;
                     the router whole; a shared expert split like a dense GLU
    Gated DeltaNet   in_proj rows, conv channels, decay parameters of the rank's key and value
                     heads; out_proj's matching columns
    vocabulary       embedding and LM-head rows of the rank's 1/t of the vocabulary

A row-parallel product gives each rank a partial sum of the layer's output; the parallel layer
kinds (`parallel_layers.py`) add the parts with one all-reduce, so a bias there stays on the
rank that carries the residual. A shard is new host data (`HostLinear` of the rows or columns
held), never a new kernel member. Parts are read with `read_part`, so a rank reads only them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from atlas.domain.models.cache_groups import CacheShape, KvShape, StateShape
from atlas.domain.models.deferred_load import DescribedAttention, DescribedDeltaNet
from atlas.domain.models.shard_reads import PartSpec, Range, read_part
from atlas.domain.parallel import RankPlacement
from atlas.ports.kernels.attention import HeadLayout, HostAttention
from atlas.ports.kernels.dense import HostProjection, HostVocab
from atlas.ports.kernels.host_weights import HostLinear, RmsNorm
from atlas.ports.kernels.moe import HostMoe, HostSharedExpert
from atlas.ports.kernels.recurrent import HostDeltaNet


class ShardingError(ValueError):
    """A layer whose weights cannot split as asked (a post-norm on a row-parallel product,
    quantization blocks that straddle ranks); the message names it."""


# -- linears ---------------------------------------------------------------------------------


def linear_rows(linear: HostLinear, rows: Sequence[Range], leading: Range | None = None) -> HostLinear:
    """The output rows `rows` (column parallelism), of experts `leading` for a stack [E, out, in]."""
    spec = _leading(linear, leading)
    weight = read_part(linear.weight, [*spec, rows, None])
    bias = None if linear.bias is None else read_part(linear.bias, [*spec, rows])
    return HostLinear(weight, bias, _scales(linear, spec, rows, None), linear.block_shape)


def linear_columns(linear: HostLinear, columns: Range, keep_bias: bool, leading: Range | None = None) -> HostLinear:
    """The input columns `columns` (row parallelism); the bias only where `keep_bias` (one
    rank's, so the sum over ranks adds it once)."""
    spec = _leading(linear, leading)
    weight = read_part(linear.weight, [*spec, None, [columns]])
    bias = read_part(linear.bias, [*spec, None]) if keep_bias and linear.bias is not None else None
    return HostLinear(weight, bias, _scales(linear, spec, None, [columns]), linear.block_shape)


def whole(linear: HostLinear) -> HostLinear:
    """The linear read in full (replicated on every rank)."""
    spec: PartSpec = [None] * np.ndim(linear.weight)
    return HostLinear(
        read_part(linear.weight, spec),
        None if linear.bias is None else read_part(linear.bias, spec[:-1]),
        None if linear.scales is None else np.asarray(linear.scales),
        linear.block_shape,
    )


def _leading(linear: HostLinear, leading: Range | None) -> list[Sequence[Range] | None]:
    stacked = len(linear.weight.shape) == 3
    if leading is not None and not stacked:
        raise ShardingError("an expert range of a linear that is not a stack of experts")
    return [None if leading is None else [leading]] if stacked else []


def _scales(linear: HostLinear, leading: list, rows: Sequence[Range] | None, columns: Sequence[Range] | None):
    if linear.scales is None:
        return None
    if linear.block_shape is None:  # per output channel
        return read_part(np.asarray(linear.scales), [*leading, rows])
    block_rows, block_columns = linear.block_shape
    out_features, in_features = linear.weight.shape[-2:]
    return read_part(np.asarray(linear.scales), [
        *leading,
        _blocks(rows, block_rows, out_features, "rows"),
        _blocks(columns, block_columns, in_features, "columns"),
    ])


def _blocks(ranges: Sequence[Range] | None, block: int, size: int, what: str) -> list[Range] | None:
    if ranges is None:
        return None
    blocks = []
    for start, stop in ranges:
        if start % block or (stop % block and stop != size):
            raise ShardingError(
                f"the {what} [{start}, {stop}) of a rank straddle the checkpoint's {block}-wide quantization blocks; "
                "choose a tensor-parallel size whose shards align with them"
            )
        blocks.append((start // block, -(-stop // block)))
    return blocks


def _norm(norm: RmsNorm | None) -> RmsNorm | None:
    return None if norm is None else RmsNorm(np.asarray(norm.weight), norm.eps)


# -- projections -----------------------------------------------------------------------------


def column_projection(projection: HostProjection, rows: Sequence[Range]) -> HostProjection:
    """A projection reading the replicated residual stream (its input norm whole), of which the
    rank computes output rows `rows`."""
    if projection.output_norm is not None:
        raise ShardingError("a column-parallel projection with a norm of its output cannot split")
    return HostProjection(linear_rows(projection.linear, rows), _norm(projection.input_norm), projection.activation)


def gated_projection(projection: HostProjection, width: Range) -> HostProjection:
    """A gated [gate; up] projection of which the rank computes `width` of the gated output."""
    half = projection.linear.out_features // 2
    start, stop = width
    return column_projection(projection, [(start, stop), (half + start, half + stop)])


def row_projection(projection: HostProjection, columns: Range, placement: RankPlacement) -> HostProjection:
    """An output projection of which the rank holds input `columns`: its product is a partial sum."""
    if projection.output_norm is not None or projection.input_norm is not None or projection.activation is not None:
        raise ShardingError(
            "a row-parallel output projection must be a plain product (a norm after it needs the whole sum)"
        )
    return HostProjection(linear_columns(projection.linear, columns, placement.carries_residual))


# -- layer kinds -----------------------------------------------------------------------------


def attention_part(described: DescribedAttention, placement: RankPlacement) -> tuple[DescribedAttention, Range]:
    """The rank's query heads and KV heads of an attention layer, and the columns of o_proj
    (`[first q head * D, last * D)`) that read them."""
    layer, host = described.layer, described.host
    heads = layer.heads
    head_dim = heads.head_dim
    q_start, q_stop = placement.split(heads.num_q_heads)
    kv_start, kv_stop = placement.kv_heads(heads.num_kv_heads)
    q_rows = (q_start * head_dim, q_stop * head_dim)
    sections = [q_rows]
    offset = heads.q_size
    if layer.gated_output:  # the gate heads follow the q heads, in their order
        sections.append((offset + q_rows[0], offset + q_rows[1]))
        offset += heads.q_size
    for _ in ("k", "v"):
        sections.append((offset + kv_start * head_dim, offset + kv_stop * head_dim))
        offset += heads.kv_size
    local_heads = HeadLayout(q_stop - q_start, kv_stop - kv_start, head_dim)
    local = HostAttention(
        input_norm=_norm(host.input_norm),
        qkv=linear_rows(host.qkv, sections),
        q_norm=_norm(host.q_norm),
        k_norm=_norm(host.k_norm),
        sinks=None if host.sinks is None else np.asarray(host.sinks)[q_start:q_stop].copy(),
    )
    return DescribedAttention(local, replace(layer, heads=local_heads)), q_rows


def moe_part(host: HostMoe, placement: RankPlacement) -> HostMoe:
    """The rank's experts (`first_expert` on) and its part of each one's width; the router and
    the routing whole, so every rank routes every token alike; a shared expert split over all
    ranks like a dense GLU."""
    experts = placement.experts(host.routing.num_experts)
    width = host.gate_up.weight.shape[-2] // 2
    start, stop = placement.expert_width(width)
    gate_up = linear_rows(host.gate_up, [(start, stop), (width + start, width + stop)], leading=experts)
    # every rank of an expert group holds the group's experts; one of them keeps down's bias
    keeps_bias = start == 0
    down = linear_columns(host.down, (start, stop), keeps_bias, leading=experts)
    shared = None
    if host.shared is not None:
        shared_width = host.shared.gate_up.out_features // 2
        s_start, s_stop = placement.split(shared_width)
        shared_rows = [(s_start, s_stop), (shared_width + s_start, shared_width + s_stop)]
        shared = HostSharedExpert(
            gate_up=linear_rows(host.shared.gate_up, shared_rows),
            down=linear_columns(host.shared.down, (s_start, s_stop), placement.carries_residual),
            gate=None if host.shared.gate is None else whole(host.shared.gate),
        )
    return HostMoe(
        input_norm=_norm(host.input_norm),
        router=whole(host.router),
        gate_up=gate_up,
        down=down,
        activation=host.activation,
        routing=host.routing,
        selection_bias=None if host.selection_bias is None else np.asarray(host.selection_bias),
        shared=shared,
        first_expert=experts[0],
    )


def delta_net_part(
    input_projection: HostProjection, described: DescribedDeltaNet, placement: RankPlacement
) -> tuple[HostProjection, DescribedDeltaNet, Range]:
    """The rank's key and value heads of a Gated DeltaNet layer: its rows of in_proj (laid out
    | q | k | v | z | b | a | as `DeltaNetLayer` says), its conv channels and decay parameters,
    and the columns of out_proj that read its value heads."""
    layer, host = described.layer, described.host
    dk, dv = layer.key_head_dim, layer.value_head_dim
    k_start, k_stop = placement.split(layer.num_key_heads)
    v_start, v_stop = placement.split(layer.num_value_heads)
    q_rows = (k_start * dk, k_stop * dk)
    v_rows = (v_start * dv, v_stop * dv)
    key, value, heads = layer.key_dim, layer.value_dim, layer.num_value_heads
    conv_channels = [q_rows, (key + q_rows[0], key + q_rows[1]), (2 * key + v_rows[0], 2 * key + v_rows[1])]
    conv = layer.conv_dim
    in_rows = [
        *conv_channels,
        (conv + v_rows[0], conv + v_rows[1]),  # z
        (conv + value + v_start, conv + value + v_stop),  # b
        (conv + value + heads + v_start, conv + value + heads + v_stop),  # a
    ]
    local_layer = replace(layer, num_key_heads=k_stop - k_start, num_value_heads=v_stop - v_start)
    local = HostDeltaNet(
        conv_weight=read_part(host.conv_weight, [conv_channels, None]),
        a_log=np.asarray(host.a_log)[v_start:v_stop].copy(),
        dt_bias=np.asarray(host.dt_bias)[v_start:v_stop].copy(),
        norm=_norm(host.norm),
    )
    return column_projection(input_projection, in_rows), DescribedDeltaNet(local, local_layer), v_rows


def vocab_part(host: HostVocab, placement: RankPlacement) -> HostVocab:
    """The rank's 1/t of the vocabulary: its embedding rows with one zero row after them (where
    a token held by another rank looks up, so the all-reduce of the lookups is exact), and its
    rows of the LM head (the embedding's rows where tied)."""
    start, stop = placement.split(int(host.embedding.shape[0]))
    rows = read_part(host.embedding, [[(start, stop)], None])
    embedding = np.concatenate([rows, np.zeros((1, rows.shape[1]), rows.dtype)])
    lm_head = HostLinear(rows) if host.lm_head is None else linear_rows(host.lm_head, [(start, stop)])
    return HostVocab(embedding, _norm(host.final_norm), lm_head, host.embedding_scale, host.logit_softcap)


def cache_shape_part(shape: CacheShape, placement: RankPlacement) -> CacheShape:
    """A cache group's per-rank shape: its KV heads, or its recurrent heads and conv channels."""
    if isinstance(shape, KvShape):
        start, stop = placement.kv_heads(shape.num_kv_heads)
        return replace(shape, num_kv_heads=stop - start)
    if isinstance(shape, StateShape):
        ranks = placement.tensor_parallel
        return replace(shape, conv_dim=shape.conv_dim // ranks, num_heads=shape.num_heads // ranks)
    raise ShardingError(f"no tensor-parallel form of the cache shape {type(shape).__name__}")

