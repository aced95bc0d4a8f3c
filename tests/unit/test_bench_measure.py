"""`atlas bench`'s decode measurement on the mock: the timed window sits on the asked context, and
the roofline counts the bytes a step reads (active experts, recurrent state)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.checkpoints import tiny_llama_gguf

from atlas.adapters.weights.gguf_import import import_gguf
from atlas.app.bench.measure import (
    BytesRead,
    engine_bytes_read,
    kv_bytes_per_token,
    measure_decode,
    routed_expert_bytes,
    weight_bytes_per_step,
)
from atlas.app.builder import build_engine
from atlas.app.settings import EngineSettings
from atlas.domain.models.config import ModelConfig


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tiny_llama_gguf(root / "tiny.gguf", np.random.default_rng(0))
    folder = import_gguf(root / "tiny.gguf", root / "model", progress=False)
    return build_engine(EngineSettings(model=str(folder), device="mock", max_num_seqs=4, max_seq_len=256))


@pytest.mark.parametrize("batch, context, steps", [(1, 40, 6), (1, 33, 7), (3, 64, 8)])
def test_the_timed_steps_centre_on_the_context(engine, batch, context, steps):
    """The prompts are shortened so the timed steps' mean context is the asked one (to half a
    token, and a little over where sequences that finish prefill first decode ahead), and the
    roofline counts the KV those steps read; every KV block is free again afterwards."""
    free = engine.core.stats().num_blocks_free  # free or cached: the aborted prompts stay cached
    result = measure_decode(engine, batch, context, steps, bandwidth=1e9)
    assert context <= result.mean_context <= context + (0.5 if batch == 1 else 2.0)
    assert result.steps == steps and result.context_len == context
    expected_bytes = weight_bytes_per_step(engine) + batch * result.mean_context * kv_bytes_per_token(engine)
    assert result.roofline_step_s == pytest.approx(expected_bytes / 1e9)
    assert engine.core.stats().num_blocks_free == free


def test_a_step_reads_the_experts_its_tokens_pick_and_each_sequences_state():
    """One token reads k of E experts; 64 tokens the expected share under uniform routing; the
    state once each way per sequence."""
    read = BytesRead(weight_bytes=1000, kv_bytes_per_token=10, expert_bytes=1280, num_experts=128, top_k=8,
                     state_bytes_per_sequence=7)
    assert read.experts_read(1) == pytest.approx(80)
    assert read.experts_read(64) == pytest.approx(1280 * (1 - (120 / 128) ** 64))
    assert read.step_bytes(64, 640.0) == pytest.approx(1000 + read.experts_read(64) + 6400 + 64 * 7)
    assert BytesRead(1000, 10).step_bytes(2, 3.0) == 1030


def test_routed_experts_are_counted_over_the_moe_layers_only():
    from atlas.app.bench.random_model import CONFIGS

    config = ModelConfig.from_dict(CONFIGS["qwen3-30b-a3b"])
    assert routed_expert_bytes(config) == 48 * 128 * 3 * 2048 * 768 * 2
    cut = ModelConfig.from_dict({**CONFIGS["qwen3-30b-a3b"], "mlp_only_layers": [0, 5]})
    assert routed_expert_bytes(cut) == 46 * 128 * 3 * 2048 * 768 * 2


def test_a_hybrid_moe_engine_reads_its_active_experts_and_its_state(tmp_path):
    """A tiny Qwen3-Next on the mock: the routed experts apart from the other weights, the state
    of its DeltaNet layers (conv and delta-rule state, f32) twice, and the roofline of a decode
    step built from both."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_models import tiny_config, write_model_folder

    write_model_folder(tmp_path, "qwen3_next")
    engine = build_engine(EngineSettings(model=str(tmp_path), device="mock", max_num_seqs=2, max_seq_len=128))
    try:
        read = engine_bytes_read(engine)
        config = tiny_config("qwen3_next")
        moe_layers = sum(layer not in config["mlp_only_layers"] for layer in range(config["num_hidden_layers"]))
        experts = moe_layers * config["num_experts"] * 3 * config["hidden_size"] * config["moe_intermediate_size"] * 2
        assert (read.expert_bytes, read.num_experts, read.top_k) == (experts, 8, 2)
        assert read.weight_bytes + read.expert_bytes == weight_bytes_per_step(engine)
        key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        conv_dim = 2 * key_dim + config["linear_num_value_heads"] * config["linear_value_head_dim"]
        recurrent = config["linear_num_value_heads"] * config["linear_key_head_dim"] * config["linear_value_head_dim"]
        per_layer = (conv_dim * (config["linear_conv_kernel_dim"] - 1) + recurrent) * 4
        assert read.state_bytes_per_sequence == 2 * 2 * per_layer  # two DeltaNet layers, read and written
        result = measure_decode(engine, 2, 20, 4, bandwidth=1e9)
        assert result.roofline_step_s == pytest.approx(read.step_bytes(2, 2 * result.mean_context) / 1e9)
    finally:
        engine.close()


def test_the_ceiling_probes_fit_what_the_loaded_engine_left_free():
    """With the KV cache holding all but a little of the device (--gpu-memory-utilization
    0.95 on an 80 GB card left 1.5 GB), the 2 GB copy probe shrinks to the free memory instead
    of failing the bench after the engine loaded; it still gives a positive rate."""
    from atlas.adapters.mock.backend import MockGpuBackend
    from atlas.app.bench.measure import measure_ceilings
    from atlas.ports.gpu import DType

    backend = MockGpuBackend(memory_bytes=400 << 20)
    hold = backend.empty((100 << 20,), DType.U8)  # the "KV cache": 300 MB stay free
    ceilings = measure_ceilings(backend, copy_bytes=2 << 30, gemm_size=256, repeats=1)
    assert ceilings.copy_bytes_per_s > 0 and ceilings.gemm_flops_per_s > 0
    assert backend.memory_info()[0] == 300 << 20  # the probes' buffers are freed again
    del hold


def test_fp8_experts_count_a_byte_an_element_in_the_roofline(tmp_path):
    """With --quantization fp8 the roofline reads the routed experts as the device holds them
    (an E4M3 byte an element and the scales), not as bf16: before, a Qwen3-30B-A3B in FP8 had
    its bf16 expert bytes taken off a total that held them at a byte, and the roofline went
    negative (-259.6% on an H200)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fp8_checkpoints import split_experts
    from safetensors.numpy import load_file, save_file
    from tiny_models import tiny_config, write_model_folder

    write_model_folder(tmp_path, "qwen3_moe")
    for path in tmp_path.glob("*.safetensors"):  # experts one by one, as published (fp8 quantizes those)
        save_file(split_experts(load_file(path)), path)
    config = tiny_config("qwen3_moe")
    engine = build_engine(EngineSettings(model=str(tmp_path), device="mock", max_num_seqs=2, max_seq_len=128,
                                         quantization="fp8"))
    try:
        read = engine_bytes_read(engine)
        moe_layers = sum(layer not in config.get("mlp_only_layers", ()) for layer in range(config["num_hidden_layers"]))
        rows = moe_layers * config["num_experts"] * (2 * config["moe_intermediate_size"] + config["hidden_size"])
        elements = moe_layers * config["num_experts"] * 3 * config["hidden_size"] * config["moe_intermediate_size"]
        assert read.expert_bytes == elements + 4 * rows  # E4M3 bytes and a scale a row
        assert 0 < read.weight_bytes and read.weight_bytes + read.expert_bytes == weight_bytes_per_step(engine)
    finally:
        engine.close()
