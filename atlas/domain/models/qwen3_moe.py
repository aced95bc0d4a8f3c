"""The Qwen3-MoE loader (Qwen3-30B-A3B, Qwen3-235B-A22B).

Every layer is Qwen3's attention (per-head q/k RMSNorm) times a feed-forward that is a mixture of
`num_experts` SwiGLU experts, the top `num_experts_per_tok` of a softmax router (renormalised
when `norm_topk_prob`), or a dense GLU on the layers `ModelConfig.is_moe_layer` leaves out
(`mlp_only_layers`, `decoder_sparse_step`). Published checkpoints store each expert's
`mlp.experts.E.{gate,up,down}_proj.weight`; transformers' fused in-memory form
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) loads too. FP8
checkpoints (Qwen3-30B-A3B-FP8: 128 x 128 blocks; llm-compressor's layouts) load with their
scales, experts included (`quantization_weights.stack_experts`).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from atlas.domain.models import decoder
from atlas.domain.models.checkpoint import CheckpointReader
from atlas.domain.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from atlas.domain.models.feed_forward import MoeFeedForward
from atlas.domain.models.layers import FeedForward, Layer
from atlas.domain.models.model import Model
from atlas.domain.models.quantization_config import read_quantization
from atlas.domain.models.quantization_weights import E4M3, stack_experts
from atlas.ports.gpu import GpuBackend, Kind
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm
from atlas.ports.kernels.moe import HostMoe, Routing
from atlas.ports.weights import WeightError, WeightSource

ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def kinds(config: ModelConfig) -> frozenset[Kind]:
    """Dense and attention, and the MoE kind where any layer routes to experts."""
    moe = any(config.is_moe_layer(layer) for layer in range(config.num_layers))
    return frozenset({Kind.DENSE, Kind.ATTENTION} | ({Kind.MOE} if moe else set()))


def load_qwen3_moe(
    config: ModelConfig,
    weights: WeightSource,
    backend: GpuBackend,
    max_positions: int,
    progress: decoder.ProgressCallback | None = None,
) -> Model:
    """Build a `Model` from a Qwen3-MoE checkpoint; raises WeightError naming a bad tensor and
    ModelConfigError naming an option Atlas does not run."""
    decoder.check_layer_types(config, (FULL_ATTENTION, SLIDING_ATTENTION))
    gated = decoder.activation(config)
    routing = decoder.routing(config, renormalize=config.norm_topk_prob) if Kind.MOE in kinds(config) else None
    reader = CheckpointReader(weights, read_quantization(config.raw))
    norm = decoder.plain_norms(reader, config.rms_norm_eps)
    groups = decoder.kv_groups(config)
    tables = decoder.rope_tables(config, backend, max_positions)
    options = decoder.AttentionOptions(norm, scale=config.head_dim**-0.5, qk_norm=True)

    def layer(index: int) -> Layer:
        mixer = decoder.attention_mixer(config, reader, backend, index, groups, tables[index], options)
        post_norm = norm(f"model.layers.{index}.post_attention_layernorm.weight", config.hidden_size)
        return Layer(mixer, _feed_forward(config, reader, backend, index, post_norm, gated, routing))

    vocab = partial(decoder.vocabulary, config, reader, backend, norm)
    return decoder.assemble(config, backend, groups, layer, vocab, progress)


def _feed_forward(
    config: ModelConfig,
    reader: CheckpointReader,
    backend: GpuBackend,
    index: int,
    norm: RmsNorm,
    gated: Activation,
    routing: Routing | None,
) -> FeedForward:
    prefix = f"model.layers.{index}.mlp"
    hidden = config.hidden_size
    if routing is None or not config.is_moe_layer(index):
        return decoder.glu_feed_forward(reader, backend, prefix, (hidden, config.intermediate_size), norm, gated)
    gate_up, down = _experts(reader, prefix, config.num_experts, hidden, config.moe_intermediate_size)
    host = HostMoe(
        input_norm=norm,
        router=reader.linear(f"{prefix}.gate", config.num_experts, hidden),
        gate_up=gate_up,
        down=down,
        activation=gated,
        routing=routing,
    )
    return MoeFeedForward(backend.moe.prepare(host), routing.top_k, hidden, config.moe_intermediate_size)


def _experts(
    reader: CheckpointReader, prefix: str, num_experts: int, hidden: int, intermediate: int
) -> tuple[HostLinear, HostLinear]:
    """(gate_up [E, 2I, H]: each expert's gate rows then its up rows, down [E, H, I])."""
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in reader:
        return (
            HostLinear(reader.array(fused, (num_experts, 2 * intermediate, hidden))),
            HostLinear(reader.array(f"{prefix}.experts.down_proj", (num_experts, hidden, intermediate))),
        )
    if reader.quantization is not None and reader.weights.get(f"{prefix}.experts.0.gate_proj.weight").dtype == E4M3:
        return _fp8_experts(reader, prefix, num_experts, hidden, intermediate)
    first = reader.array(f"{prefix}.experts.0.gate_proj.weight", (intermediate, hidden))
    gate_up = np.empty((num_experts, 2 * intermediate, hidden), first.dtype)
    down = np.empty((num_experts, hidden, intermediate), first.dtype)
    for expert in range(num_experts):  # one expert at a time: no second copy of the layer's experts
        name = f"{prefix}.experts.{expert}"
        gate_up[expert, :intermediate] = reader.array(f"{name}.gate_proj.weight", (intermediate, hidden))
        gate_up[expert, intermediate:] = reader.array(f"{name}.up_proj.weight", (intermediate, hidden))
        down[expert] = reader.array(f"{name}.down_proj.weight", (hidden, intermediate))
    return HostLinear(gate_up), HostLinear(down)


def _fp8_experts(
    reader: CheckpointReader, prefix: str, num_experts: int, hidden: int, intermediate: int
) -> tuple[HostLinear, HostLinear]:
    """The experts of an FP8 checkpoint, E4M3 with their scales, each read like a projection
    (gate | up fused by rows); raises WeightError naming an expert stored otherwise."""
    gate_up, down = [], []
    for expert in range(num_experts):
        name = f"{prefix}.experts.{expert}"
        gate_up.append(reader.stacked_linear([(f"{name}.gate_proj", intermediate), (f"{name}.up_proj", intermediate)],
                                             hidden))
        down.append(reader.linear(f"{name}.down_proj", hidden, intermediate))
    try:
        return stack_experts(gate_up), stack_experts(down)
    except ValueError as error:
        raise WeightError(f"{prefix}.experts: {error} (FP8 and float experts, or different scale layouts)") from None
