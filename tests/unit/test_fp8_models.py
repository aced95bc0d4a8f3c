"""FP8 models on the mock against transformers on the dequantized weights, in every published
layout and with `--quantization fp8`: the mock computes with the exact dequantization, so its
logits agree with the reference to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from fakes import DictWeights  # noqa: E402
from helpers.engines import make_worker  # noqa: E402
from fp8_checkpoints import CONFIGS, LAYOUTS, load_dequantized, quantize_checkpoint, split_experts  # noqa: E402
from tiny_models import build_reference, reference_logits, tiny_config  # noqa: E402

from atlas.adapters.mock.backend import MockGpuBackend  # noqa: E402
from atlas.domain.batch import BlockTable, SamplingRow, ScheduledBatch, ScheduledSequence  # noqa: E402
from atlas.domain.models.config import ModelConfig  # noqa: E402
from atlas.domain.models.families import fp8_layouts, load_model  # noqa: E402
from atlas.domain.models.quantization_config import (  # noqa: E402
    QuantizationError,
    check_quantization,
    with_quantization,
)
from atlas.domain.models.quantization_weights import QuantizedOnLoad, checkpoint_bytes  # noqa: E402
from atlas.domain.worker import WorkerConfig  # noqa: E402

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
    num_groups = len(model.cache_groups)  # Gemma 3's sliding and full layers: a table each
    for index, prompt in enumerate(prompts):
        count = -(-len(prompt) // BLOCK_SIZE)
        tables = [tuple(range(first + group * count, first + (group + 1) * count)) for group in range(num_groups)]
        kv_tables = tuple(BlockTable(table) for table in tables) if num_groups > 1 else ()
        sequences.append(ScheduledSequence(f"s{index}", tuple(prompt), 0, tables[0], GREEDY, kv_block_tables=kv_tables))
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
    config = ModelConfig.from_dict(tiny_config("qwen3_next"))
    assert fp8_layouts(config) == () and fp8_layouts(ModelConfig.from_dict(MOE_CONFIG))
    for quantization_config in CONFIGS.values():
        with pytest.raises(QuantizationError, match="loads Qwen3NextForCausalLM from float weights only"):
            check_quantization({"quantization_config": quantization_config}, fp8_layouts(config), config.architecture)


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
