"""Each family end to end: a tiny random checkpoint as transformers writes it (config.json, bf16
safetensors under the published names) is served by `atlas.LLM(..., device="mock")`, and under
teacher forcing its logprobs stay within 1e-3 of transformers in float32 over 64 generated
tokens. Two prompts of different lengths run batched; the 16-token step budget chunks both,
and prompt plus output cross the families' 16-token sliding windows many times over."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.checkpoints import mxfp4_values, quantize_mxfp4, save_transformers_folder  # noqa: E402
from tiny_models import build_reference, tiny_config  # noqa: E402

import atlas  # noqa: E402

pytestmark = pytest.mark.oracle

PROMPT_LENGTHS = (40, 23)
NUM_GENERATED = 64
TOLERANCE = 1e-3
NUM_TOP = 3


def _serve(folder: Path) -> atlas.LLM:
    return atlas.LLM(str(folder), device="mock", show_progress=False, max_seq_len=256, max_prefill_tokens=16,
                     block_size=8, max_num_seqs=4, kv_cache_gb=0.01)


def _teacher_forced_errors(llm: atlas.LLM, reference, rng: np.random.Generator) -> list[float]:
    """Per prompt, the largest gap between Atlas's logprobs (the chosen token's and the top
    ones') and transformers' over the same tokens."""
    vocab_size = reference.config.vocab_size
    prompts = [[int(t) for t in rng.integers(0, vocab_size, size=n)] for n in PROMPT_LENGTHS]
    params = atlas.SamplingParams(temperature=0.0, max_tokens=NUM_GENERATED, logprobs=NUM_TOP, ignore_eos=True)
    errors = []
    for prompt, result in zip(prompts, llm.generate(prompts, params), strict=True):
        choice = result.outputs[0]
        assert len(choice.token_ids) == NUM_GENERATED and len(choice.logprobs) == NUM_GENERATED
        tokens = prompt + choice.token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1 :]
        expected = torch.log_softmax(logits.double(), dim=-1).numpy()  # [64, V]
        gaps = [0.0]
        for step, entry in enumerate(choice.logprobs):
            gaps.append(abs(entry.logprob - expected[step, entry.token_id]))
            gaps.extend(abs(logprob - expected[step, token]) for token, logprob in entry.top)
        errors.append(max(gaps))
    return errors


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3", "gpt_oss"])
def test_a_transformers_checkpoint_is_served_with_its_logprobs(family, tmp_path, rng):
    reference, _ = build_reference(tiny_config(family), seed=7)
    llm = _serve(save_transformers_folder(reference, tmp_path / family))
    errors = _teacher_forced_errors(llm, reference, rng)
    assert max(errors) < TOLERANCE, (family, errors)
    assert llm.engine.core.stats().num_blocks_free == llm.engine.core.stats().num_blocks_total


def test_gpt_oss_with_mxfp4_experts_is_served_as_transformers_reads_it(tmp_path, rng):
    """The experts written as MXFP4 blocks and scales (quantized here from the OCP spec), the
    config's quantization_config naming mxfp4: Atlas dequantizes at load, and its logprobs match
    transformers' own reading of the same folder."""
    model, _ = build_reference(tiny_config("gpt_oss"), seed=8)
    folder = _mxfp4_folder(model, tmp_path / "gpt-oss-mxfp4")
    from transformers import AutoModelForCausalLM, Mxfp4Config

    reference = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True), attn_implementation="eager"
    ).eval()
    expert = reference.model.layers[1].mlp.experts.down_proj
    assert torch.equal(expert, model.model.layers[1].mlp.experts.down_proj)  # the quantized values, read back
    errors = _teacher_forced_errors(_serve(folder), reference, rng)
    assert max(errors) < TOLERANCE, errors


def _mxfp4_folder(model, folder: Path) -> Path:
    """`model` saved as gpt-oss checkpoints are: each expert tensor as `<name>_blocks` and
    `<name>_scales` over rows of output features (the float parameter's transpose). The model's
    experts are set to the quantized values, so it stays the float reference of the folder."""
    from safetensors.torch import load_file, save_file

    quantized = {}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                parameter = getattr(layer.mlp.experts, name)  # [E, in, out]
                blocks, scales = quantize_mxfp4(parameter.numpy().transpose(0, 2, 1))
                parameter.copy_(torch.from_numpy(mxfp4_values(blocks, scales).transpose(0, 2, 1).copy()))
                quantized[f"model.layers.{index}.mlp.experts.{name}"] = (blocks, scales)
    save_transformers_folder(model, folder)
    tensors = load_file(folder / "model.safetensors")
    for name, (blocks, scales) in quantized.items():
        del tensors[name]
        tensors[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
        tensors[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder
