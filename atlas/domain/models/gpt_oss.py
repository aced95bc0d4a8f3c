"""The GPT-OSS loader (gpt-oss-20b, gpt-oss-120b).

Layers alternate sliding-window and full attention (`layer_types`, or every other layer full),
all with one YaRN RoPE; attention has q/k/v/o biases and a learned sink logit per head. Every
feed-forward is a mixture of experts: a router with a bias, a softmax over the top-k logits,
experts with biases and the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).

The experts are stacked tensors whose gate and up outputs interleave (gate, up, gate, up, ...):

    float   mlp.experts.gate_up_proj [E, H, 2I] (x @ it), gate_up_proj_bias [E, 2I]
            mlp.experts.down_proj [E, I, H], down_proj_bias [E, H]
    MXFP4   mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16] u8, gate_up_proj_scales [E, 2I, H/32]
            mlp.experts.down_proj_blocks [E, H, I/32, 16], down_proj_scales [E, H, I/32]
            (rows are output features: the transpose of the float form; `mxfp4.py` dequantizes)

Published checkpoints are MXFP4 (quant_method "mxfp4"): dequantized to bf16 here, at load.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from atlas.domain.models import decoder, mxfp4
from atlas.domain.models.checkpoint import CheckpointReader
from atlas.domain.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from atlas.domain.models.feed_forward import MoeFeedForward
from atlas.domain.models.layers import Layer
from atlas.domain.models.model import Model
from atlas.ports.gpu import GpuBackend, Kind
from atlas.ports.kernels.host_weights import ClampedSwiglu, HostLinear, RmsNorm
from atlas.ports.kernels.moe import HostMoe, Routing
from atlas.ports.weights import WeightSource

ARCHITECTURES = ("GptOssForCausalLM",)


def kinds(config: ModelConfig) -> frozenset[Kind]:
    return frozenset({Kind.DENSE, Kind.ATTENTION, Kind.MOE})


def load_gpt_oss(
    config: ModelConfig,
    weights: WeightSource,
    backend: GpuBackend,
    max_positions: int,
    progress: decoder.ProgressCallback | None = None,
) -> Model:
    """Build a `Model` from a GPT-OSS checkpoint (float or MXFP4 experts); raises WeightError
    naming a bad tensor and ModelConfigError naming an option Atlas does not run."""
    decoder.check_layer_types(config, (FULL_ATTENTION, SLIDING_ATTENTION))
    routing = decoder.routing(config, renormalize=True)  # a softmax over the top-k logits
    reader = CheckpointReader(weights)
    norm = decoder.plain_norms(reader, config.rms_norm_eps)
    groups = decoder.kv_groups(config)
    tables = decoder.rope_tables(config, backend, max_positions)
    options = decoder.AttentionOptions(norm, scale=config.head_dim**-0.5, sinks=True)

    def layer(index: int) -> Layer:
        mixer = decoder.attention_mixer(config, reader, backend, index, groups, tables[index], options)
        post_norm = norm(f"model.layers.{index}.post_attention_layernorm.weight", config.hidden_size)
        return Layer(mixer, _moe(config, reader, backend, index, post_norm, routing))

    vocab = partial(decoder.vocabulary, config, reader, backend, norm)
    return decoder.assemble(config, backend, groups, layer, vocab, progress)


def _moe(
    config: ModelConfig, reader: CheckpointReader, backend: GpuBackend, index: int, norm: RmsNorm, routing: Routing
) -> MoeFeedForward:
    prefix = f"model.layers.{index}.mlp"
    experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
    gate_up = _expert_weight(reader, f"{prefix}.experts.gate_up_proj", experts, 2 * inner, hidden)
    down = _expert_weight(reader, f"{prefix}.experts.down_proj", experts, hidden, inner)
    gate_up_bias = reader.array(f"{prefix}.experts.gate_up_proj_bias", (experts, 2 * inner))
    # [gate; up] rows as the MoE kind takes them, from the checkpoint's interleaved ones
    order = np.concatenate([np.arange(0, 2 * inner, 2), np.arange(1, 2 * inner, 2)])
    host = HostMoe(
        input_norm=norm,
        router=reader.linear(f"{prefix}.router", experts, hidden, bias=True),
        gate_up=HostLinear(gate_up[:, order], gate_up_bias[:, order]),
        down=HostLinear(down, reader.array(f"{prefix}.experts.down_proj_bias", (experts, hidden))),
        activation=ClampedSwiglu(config.swiglu_alpha, config.swiglu_limit),
        routing=routing,
    )
    return MoeFeedForward(backend.moe.prepare(host), routing.top_k, hidden, inner)


def _expert_weight(reader: CheckpointReader, name: str, experts: int, rows: int, columns: int) -> np.ndarray:
    """The experts' [E, rows, columns] (output features x input features), from MXFP4
    `<name>_blocks` / `<name>_scales` or from the float `<name>` stored transposed."""
    if f"{name}_blocks" in reader:
        groups = columns // mxfp4.BLOCK_SIZE
        blocks = reader.array(f"{name}_blocks", (experts, rows, groups, mxfp4.BLOCK_SIZE // 2))
        return mxfp4.dequantize(blocks, reader.array(f"{name}_scales", (experts, rows, groups)), name)
    return reader.array(name, (experts, columns, rows)).transpose(0, 2, 1)
