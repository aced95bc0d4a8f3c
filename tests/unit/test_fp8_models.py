"""FP8 models on the mock against transformers on the dequantized weights, in every published
layout and with `--quantization fp8`: the mock computes with the exact dequantization, so its
logits agree with the reference to float32 rounding."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from fakes import DictWeights  # noqa: E402
from helpers.engines import make_worker  # noqa: E402
from fp8_checkpoints import (  # noqa: E402
    CONFIGS,
    LAYOUTS,
    PROJECTIONS,
    load_dequantized,
    quantize_checkpoint,
    split_experts,
)
from tiny_models import build_reference, reference_logits, tiny_config  # noqa: E402

from atlas.adapters.mock.backend import MockGpuBackend  # noqa: E402
from atlas.adapters.mock.dense import rmsnorm  # noqa: E402
from atlas.domain.batch import BlockTable, SamplingRow, ScheduledBatch, ScheduledSequence  # noqa: E402
from atlas.domain.models.cache_groups import CacheGroupKind  # noqa: E402
from atlas.domain.models import qwen3_next  # noqa: E402
from atlas.domain.models.config import ModelConfig  # noqa: E402
from atlas.domain.models.families import fp8_layouts, load_model  # noqa: E402
from atlas.domain.models.quantization_config import (  # noqa: E402
    Fp8Layout,
    QuantizationError,
    check_quantization,
    with_quantization,
)
from atlas.domain.models.quantization_weights import QuantizedOnLoad, checkpoint_bytes  # noqa: E402
from atlas.domain.worker import WorkerConfig  # noqa: E402
from atlas.ports.weights import WeightError  # noqa: E402

pytestmark = pytest.mark.oracle

BLOCK_SIZE = 4
GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)
# q: 4 x 64 and k, v: 2 x 64 rows fuse into whole 128-row tiles; the hidden size 320 leaves a
# partial column tile, the intermediate size 384 three whole row tiles per half of gate | up.
CONFIG = tiny_config("llama3", hidden_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     intermediate_size=384, num_hidden_layers=2)


class RecordingMock(MockGpuBackend):
    """The mock, noting every `HostLinear` its kinds prepare (to see what format reaches them)."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = []
        dense_prepare, attention_prepare = self.dense.prepare, self.attention.prepare
        vocab_prepare = self.dense.prepare_vocab

        def dense(host):
            self.linears.append(("dense", host.linear))
            return dense_prepare(host)

        def attention(host, layer):
            self.linears.append(("qkv", host.qkv))
            return attention_prepare(host, layer)

        def vocab(host):
            self.linears.append(("lm_head", host.lm_head))
            return vocab_prepare(host)

        self.dense.prepare, self.attention.prepare, self.dense.prepare_vocab = dense, attention, vocab


def logits_of(config: dict, weights, backend, prompts: list[list[int]]) -> np.ndarray:
    model_config = ModelConfig.from_dict(config)
    model = load_model(model_config, weights, backend, max_positions=512)
    worker = make_worker(model, 100, BLOCK_SIZE, WorkerConfig(256, 8, 512))
    sequences, first = [], 0
    # Gemma 3's sliding and full layers: a table each; Qwen3-Next's DeltaNet layers: a state slot
    num_groups = sum(group.kind is not CacheGroupKind.RECURRENT_STATE for group in model.cache_groups)
    slots = len(model.cache_groups) - num_groups
    for index, prompt in enumerate(prompts):
        count = -(-len(prompt) // BLOCK_SIZE)
        tables = [tuple(range(first + group * count, first + (group + 1) * count)) for group in range(num_groups)]
        kv_tables = tuple(BlockTable(table) for table in tables) if num_groups > 1 or slots else ()
        sequences.append(ScheduledSequence(f"s{index}", tuple(prompt), 0, tables[0], GREEDY, kv_block_tables=kv_tables,
                                           state_slots=(index,) * slots))
        first += num_groups * count
    return worker.compute_logits(ScheduledBatch(0, tuple(sequences), BLOCK_SIZE))


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_fp8_checkpoint_computes_its_dequantized_weights(layout, rng):
    reference, tensors = build_reference(CONFIG, seed=2)
    stored, quantization_config, dequantized = quantize_checkpoint(tensors, layout)
    load_dequantized(reference, dequantized)
    backend = RecordingMock()
    prompts = [[int(t) for t in rng.integers(0, CONFIG["vocab_size"], size=n)] for n in (1, 7, 40)]
    logits = logits_of({**CONFIG, "quantization_config": quantization_config}, DictWeights(stored), backend, prompts)
    for row, prompt in enumerate(prompts):
        assert relative_error(logits[row], reference_logits(reference, prompt)[-1]) < 1e-4, (layout, len(prompt))
    block = (128, 128) if layout == "block" else None
    projections = [linear for kind, linear in backend.linears if kind != "lm_head"]
    assert len(projections) == 4 * CONFIG["num_hidden_layers"]  # qkv, o, gate_up, down
    for linear in projections:
        assert linear.weight.dtype == np.dtype("float8_e4m3fn") and linear.block_shape == block
        expected_scales = (-(-linear.out_features // 128), -(-linear.in_features // 128)) if block else (
            linear.out_features,)
        assert linear.scales.shape == expected_scales
    lm_head = next(linear for kind, linear in backend.linears if kind == "lm_head")
    assert lm_head.scales is None and lm_head.weight.dtype != np.dtype("float8_e4m3fn")


# Qwen3-MoE: 4 x 64 query rows and 2 x 64 key / value rows fill whole 128-row tiles, as do the
# experts' 128 gate and 128 up rows; layer 1 is a dense GLU (mlp_only_layers).
MOE_CONFIG = tiny_config("qwen3_moe", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         moe_intermediate_size=128, intermediate_size=256)
GEMMA_CONFIG = tiny_config("gemma3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           intermediate_size=256)


@pytest.mark.parametrize("config", [MOE_CONFIG, GEMMA_CONFIG], ids=["qwen3_moe", "gemma3"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_decoder_families_load_fp8_checkpoints_experts_included(config, layout, rng):
    """Qwen3-30B-A3B-FP8's families: attention, dense GLUs and every MoE expert read as E4M3 with
    their scales (the router stays float, as published), computing the dequantized weights."""
    reference, tensors = build_reference(config, seed=2)
    stored, quantization_config, dequantized = quantize_checkpoint(split_experts(tensors), layout)
    assert sum(".experts." in name for name in dequantized) == (3 * 8 * 2 if config is MOE_CONFIG else 0)
    load_dequantized(reference, dequantized)
    backend = RecordingMock()
    moe_prepare, experts = backend.moe.prepare, []
    backend.moe.prepare = lambda host: experts.extend([host.gate_up, host.down]) or moe_prepare(host)
    prompts = [[int(t) for t in rng.integers(0, config["vocab_size"], size=n)] for n in (1, 9)]
    logits = logits_of({**config, "quantization_config": quantization_config}, DictWeights(stored), backend, prompts)
    for row, prompt in enumerate(prompts):
        assert relative_error(logits[row], reference_logits(reference, prompt)[-1]) < 1e-4, (layout, len(prompt))
    projections = [linear for kind, linear in backend.linears if kind != "lm_head"] + experts
    assert len(projections) == 4 * config["num_hidden_layers"]  # attention 2, and a GLU's or experts' 2
    assert len(experts) == (4 if config is MOE_CONFIG else 0)  # two MoE layers: their gate_up and down stacks
    for linear in projections:
        assert linear.weight.dtype == np.dtype("float8_e4m3fn") and linear.scales is not None


def test_a_family_that_reads_float_weights_only_refuses_fp8_naming_the_architecture():
    config = ModelConfig.from_dict(tiny_config("gpt_oss"))
    assert fp8_layouts(config) == () and fp8_layouts(ModelConfig.from_dict(MOE_CONFIG))
    assert fp8_layouts(ModelConfig.from_dict(tiny_config("qwen3_next"))) == tuple(Fp8Layout)
    for quantization_config in CONFIGS.values():
        with pytest.raises(QuantizationError, match="loads GptOssForCausalLM from float weights only"):
            check_quantization({"quantization_config": quantization_config}, fp8_layouts(config), config.architecture)


# Qwen3-Next with the head sizes of the published model: 128-row q and gate heads, DeltaNet
# heads of 128 (in_proj_qkvz moves in whole tiles when regrouped), experts and shared expert of
# 128 rows; DeltaNet, attention, DeltaNet (a dense GLU), attention.
NEXT_CONFIG = tiny_config("qwen3_next", hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                          linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                          linear_value_head_dim=128, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                          intermediate_size=256)
NEXT_LINEARS = (*PROJECTIONS, "in_proj_qkvz", "in_proj_ba", "out_proj", "gate", "shared_expert_gate", "fc")
# What each publisher leaves in bf16: Qwen3-Next-80B-A3B-*-FP8 (block; AutoFP8 likewise) the router,
# shared_expert_gate and in_proj_ba of every layer; llm-compressor's FP8 recipes the router and gate.
NEXT_SKIPPED = {"block": ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba"),
                "auto_fp8": ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba"),
                "channel": ("mlp.gate", "mlp.shared_expert_gate"), "tensor": ("mlp.gate", "mlp.shared_expert_gate")}
FP8 = np.dtype("float8_e4m3fn")


def _as_backend_holds(dequantized: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    """The dequantized weights, those of `names` rounded to bf16: a projection Atlas holds as
    float (FP8 rows fused with float ones), which both backends store in bf16."""
    return {name: (value.astype(ml_dtypes.bfloat16).astype(np.float32) if name in names else value)
            for name, value in dequantized.items()}


def _recording_moe(backend: RecordingMock) -> list:
    hosts, prepare = [], backend.moe.prepare
    backend.moe.prepare = lambda host: hosts.append(host) or prepare(host)
    return hosts


@pytest.mark.parametrize("layout", LAYOUTS)
def test_qwen3_next_loads_its_fp8_checkpoints_as_published(layout, rng):
    """Every projection as stored: attention, DeltaNet out_proj, dense GLU, experts and shared
    expert in FP8 with their scales; the router and shared_expert_gate float. The DeltaNet
    in_proj is FP8 where in_proj_qkvz and in_proj_ba both are (regrouped by rows with their
    scales), else float: the published block checkpoint leaves in_proj_ba in bf16."""
    reference, tensors = build_reference(NEXT_CONFIG, seed=2)
    stored, quantization_config, dequantized = quantize_checkpoint(split_experts(tensors), layout, NEXT_LINEARS,
                                                                   NEXT_SKIPPED[layout])
    assert sum(".experts." in name for name in dequantized) == 3 * 8 * 3  # three MoE layers
    assert not any(name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) for name in dequantized)
    fp8_in_proj = layout == "channel"  # both parts FP8; the per-tensor config targets *_proj only
    in_proj = [] if fp8_in_proj else [name for name in dequantized if "in_proj_qkvz" in name]
    assert len(in_proj) == (0 if layout in ("channel", "tensor") else 2)
    load_dequantized(reference, _as_backend_holds(dequantized, in_proj))
    backend = RecordingMock()
    moe = _recording_moe(backend)
    prompts = [[int(t) for t in rng.integers(0, NEXT_CONFIG["vocab_size"], size=n)] for n in (1, 9, 30)]
    config = {**NEXT_CONFIG, "quantization_config": quantization_config}
    logits = logits_of(config, DictWeights(stored), backend, prompts)
    for row, prompt in enumerate(prompts):
        assert relative_error(logits[row], reference_logits(reference, prompt)[-1]) < 1e-4, (layout, len(prompt))
    in_proj_rows = 4 * 128 * 2 + 2 * 2  # q, k, v, z of two key heads, b and a of two value heads
    projections = [linear for kind, linear in backend.linears if kind != "lm_head"]
    assert len(projections) == 2 * 2 + 2 * 2 + 2  # qkv and o, in_proj and out_proj, a dense GLU
    for linear in projections:
        fp8 = linear.out_features != in_proj_rows or fp8_in_proj
        assert (linear.weight.dtype == FP8 and linear.scales is not None) == fp8, (layout, linear.out_features)
    assert len(moe) == 3
    for host in moe:
        for linear in (host.gate_up, host.down, host.shared.gate_up, host.shared.down):
            assert linear.weight.dtype == FP8 and linear.scales is not None
        assert host.router.scales is None and host.shared.gate.scales is None


def test_qwen3_next_heads_that_split_a_tile_are_dequantized_and_experts_that_do_are_refused(rng):
    """The tiny model's 32-row heads and 16-row DeltaNet heads cut 128-row tiles when regrouped:
    those projections are read as float (bf16 on the backend), the rest stay FP8. Experts whose
    gate rows end mid-tile cannot be fused into gate | up: refused, naming them."""
    small = tiny_config("qwen3_next", hidden_size=128)
    stored, quantization_config, _ = quantize_checkpoint(split_experts(build_reference(small)[1]), "block",
                                                         NEXT_LINEARS, NEXT_SKIPPED["block"])
    with pytest.raises(WeightError, match=r"experts\.0\.gate_proj.*multiple of 128 rows"):
        load_model(ModelConfig.from_dict({**small, "quantization_config": quantization_config}), DictWeights(stored),
                   MockGpuBackend(), max_positions=64)
    config = tiny_config("qwen3_next", hidden_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                         intermediate_size=128)
    reference, tensors = build_reference(config, seed=3)
    stored, quantization_config, dequantized = quantize_checkpoint(split_experts(tensors), "block", NEXT_LINEARS,
                                                                   NEXT_SKIPPED["block"])
    regrouped = [name for name in dequantized if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                                 "in_proj_qkvz.weight"))]
    load_dequantized(reference, _as_backend_holds(dequantized, regrouped))
    backend = RecordingMock()
    moe = _recording_moe(backend)
    prompts = [[int(t) for t in rng.integers(0, config["vocab_size"], size=n)] for n in (2, 17)]
    logits = logits_of({**config, "quantization_config": quantization_config}, DictWeights(stored), backend, prompts)
    for row, prompt in enumerate(prompts):
        assert relative_error(logits[row], reference_logits(reference, prompt)[-1]) < 1e-4
    qkv = [linear for kind, linear in backend.linears if kind == "qkv"]
    assert qkv and all(linear.scales is None and linear.weight.dtype == np.float32 for linear in qkv)
    assert all(host.gate_up.weight.dtype == FP8 and host.shared.down.scales is not None for host in moe)


def test_quantization_fp8_at_load_on_qwen3_next_quantizes_its_projections(rng):
    """`--quantization fp8` on a bf16 Qwen3-Next (experts one tensor each, as published): every
    `*_proj` (attention, out_proj, GLUs, experts) per channel; in_proj_qkvz / in_proj_ba, the
    router and the gates stay bf16."""
    reference, tensors = build_reference(tiny_config("qwen3_next"), seed=5)
    split = split_experts(tensors)
    _, _, dequantized = quantize_checkpoint(split, "channel", (*PROJECTIONS, "out_proj"))
    load_dequantized(reference, dequantized)
    backend = RecordingMock()
    moe = _recording_moe(backend)
    prompts = [[int(t) for t in rng.integers(0, 512, size=n)] for n in (4, 21)]
    config = with_quantization(tiny_config("qwen3_next"), "fp8")
    logits = logits_of(config, QuantizedOnLoad(DictWeights(split)), backend, prompts)
    for row, prompt in enumerate(prompts):
        assert relative_error(logits[row], reference_logits(reference, prompt)[-1]) < 1e-4
    in_proj = [linear for kind, linear in backend.linears if kind == "dense" and linear.out_features == 192 + 8]
    assert len(in_proj) == 2 and all(linear.scales is None for linear in in_proj)
    assert all(host.gate_up.scales is not None and host.shared.gate_up.scales is not None for host in moe)


def test_quantization_fp8_at_load_is_the_per_channel_checkpoint(rng):
    """`--quantization fp8` reads a bf16 checkpoint as llm-compressor's per-channel layout: the
    same values as the published form, a byte per projection weight."""
    reference, tensors = build_reference(CONFIG, seed=4)
    _, _, dequantized = quantize_checkpoint(tensors, "channel")
    load_dequantized(reference, dequantized)
    stored = DictWeights(tensors)
    prompts = [[int(t) for t in rng.integers(0, CONFIG["vocab_size"], size=n)] for n in (3, 30)]
    config = with_quantization(CONFIG, "fp8")
    logits = logits_of(config, QuantizedOnLoad(stored), MockGpuBackend(), prompts)
    for row, prompt in enumerate(prompts):
        assert relative_error(logits[row], reference_logits(reference, prompt)[-1]) < 1e-4
    projection_elements = sum(v.size for k, v in tensors.items() if k.endswith("_proj.weight"))
    rows = sum(v.shape[0] for k, v in tensors.items() if k.endswith("_proj.weight"))
    assert checkpoint_bytes(stored) - checkpoint_bytes(stored, quantize=True) == projection_elements - 4 * rows


def test_the_engine_quantizes_at_load_and_counts_the_bytes_it_holds(tmp_path):
    from helpers.checkpoints import tiny_llama_gguf

    from atlas.adapters.weights.gguf_import import import_gguf
    from atlas.app.llm import LLM
    from atlas.domain.requests import SamplingParams

    tiny_llama_gguf(tmp_path / "tiny.gguf", np.random.default_rng(0))
    folder = str(import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    float_llm = LLM(folder, device="mock", show_progress=False, max_seq_len=128)
    fp8_llm = LLM(folder, device="mock", show_progress=False, max_seq_len=128, quantization="fp8")
    assert fp8_llm.engine.config.raw["quantization_config"]["format"] == "float-quantized"
    assert fp8_llm.engine.weight_bytes < float_llm.engine.weight_bytes
    outputs = fp8_llm.generate([[1, 2, 3, 4]], params)
    assert len(outputs[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_the_mtp_head_of_an_fp8_checkpoint_loads_its_projections_as_stored(layout, rng):
    """An MTP head quantized like the layers (fc included; a checkpoint that leaves fc in bf16
    loads it as float): fc splits into its two projections on the 128-column tile boundary
    with its scales, and its layer's attention and experts stay FP8."""
    _, tensors = build_reference(NEXT_CONFIG, seed=6)
    hidden = NEXT_CONFIG["hidden_size"]
    mtp = {name.replace("model.layers.1.", "mtp.layers.0."): value
           for name, value in tensors.items() if name.startswith("model.layers.1.")}
    mtp["mtp.fc.weight"] = (rng.standard_normal((hidden, 2 * hidden)) * 0.1).astype(np.float32)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = (rng.standard_normal(hidden) * 0.1).astype(np.float32)
    stored, quantization_config, dequantized = quantize_checkpoint(
        split_experts({**tensors, **mtp}), layout, NEXT_LINEARS, NEXT_SKIPPED[layout])
    assert "mtp.fc.weight" in dequantized and "mtp.layers.0.mlp.experts.7.down_proj.weight" in dequantized
    config = ModelConfig.from_dict({**NEXT_CONFIG, "quantization_config": quantization_config})
    backend = RecordingMock()
    moe = _recording_moe(backend)
    head = qwen3_next.load_mtp(config, DictWeights(stored), backend, 64)
    embedding, state = rng.standard_normal((2, 3, hidden)).astype(np.float32)
    out = backend.upload(np.zeros((3, hidden), np.float32))
    backend.dense.project(backend.upload(embedding), head.embedding_projection, out)
    backend.dense.project_add(backend.upload(state), head.hidden_projection, out)
    eps = config.rms_norm_eps
    joined = np.concatenate([rmsnorm(embedding, 1 + mtp["mtp.pre_fc_norm_embedding.weight"], eps),
                             rmsnorm(state, 1 + mtp["mtp.pre_fc_norm_hidden.weight"], eps)], axis=1)
    np.testing.assert_allclose(backend.download(out), joined @ dequantized["mtp.fc.weight"].T, rtol=1e-4, atol=1e-4)
    fc = [linear for kind, linear in backend.linears if kind == "dense"][-2:]  # after the layer's o_proj
    scales = (2, 2) if layout == "block" else (hidden,)
    assert all(linear.weight.dtype == FP8 and linear.scales.shape == scales for linear in fc)
    qkv = next(linear for kind, linear in backend.linears if kind == "qkv")
    assert qkv.weight.dtype == FP8 and moe[0].gate_up.weight.dtype == FP8 and moe[0].router.scales is None


@pytest.mark.parametrize("layout", ["channel", "auto_fp8"])
def test_qwen3_5_moe_loads_fp8_with_its_deltanet_projections_split(layout, rng):
    """Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a fuse in stored order: FP8 when
    all four are (per channel), float when in_proj_b / in_proj_a are left in bf16."""
    config = tiny_config("qwen3_5_moe")
    reference, tensors = build_reference(config, seed=7)
    skip = ("mlp.gate", "mlp.shared_expert_gate") + (("in_proj_b", "in_proj_a") if layout == "auto_fp8" else ())
    linears = (*NEXT_LINEARS, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    stored, quantization_config, dequantized = quantize_checkpoint(split_experts(tensors), layout, linears, skip)
    fused_as_float = [] if layout == "channel" else [name for name in dequantized if ".in_proj_" in name]
    load_dequantized(reference, _as_backend_holds(dequantized, fused_as_float))
    backend = RecordingMock()
    prompts = [[int(t) for t in rng.integers(0, config["vocab_size"], size=n)] for n in (3, 14)]
    logits = logits_of({**config, "quantization_config": quantization_config}, DictWeights(stored), backend, prompts)
    for row, prompt in enumerate(prompts):
        assert relative_error(logits[row], reference_logits(reference, prompt)[-1]) < 1e-4, layout
    in_proj = [linear for kind, linear in backend.linears if kind == "dense" and linear.out_features == 192 + 8]
    assert len(in_proj) == 2 and all((linear.scales is not None) == (layout == "channel") for linear in in_proj)
