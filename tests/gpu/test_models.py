"""Whole models on CUDA: random-weight real configs against transformers, SmolLM2 against the mock.

Run on a GPU machine: `python -m pytest tests/gpu/test_models.py -m gpu`. The transformers
reference runs on the same GPU when torch sees it.
"""

from __future__ import annotations

import copy as copy_module
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from chat_prompts import CHAT_PROMPTS  # noqa: E402
from fakes import DictWeights  # noqa: E402
from helpers.engines import make_worker  # noqa: E402
from tiny_models import build_reference  # noqa: E402

from atlas.domain.batch import BlockTable, SamplingRow, ScheduledBatch, ScheduledSequence  # noqa: E402
from atlas.domain.models.cache_groups import kv_group_indices  # noqa: E402
from atlas.domain.models.config import ModelConfig  # noqa: E402
from atlas.domain.models.families import load_model  # noqa: E402
from atlas.domain.requests import SamplingParams  # noqa: E402
from atlas.domain.worker import Worker, WorkerConfig  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402
from atlas.ports.kernels.attention import KvCacheSpec  # noqa: E402

pytestmark = pytest.mark.gpu

GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)
BLOCK_SIZE = 16

# Real configs, cut to a few layers (head dims, GQA ratios, vocabularies and RoPE are the real ones).
LLAMA_3_2_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    initializer_range=0.02,
)
# Wider than 2048: the norm weights are folded into qkv, gate_up and the untied lm_head.
LLAMA_3_1_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    initializer_range=0.02,
)
QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
    attention_bias=False, initializer_range=0.02,
)


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _hf_model(model, dtype):
    """`model` on the device, or a copy whose parameters are cast to `dtype` as
    `from_pretrained(dtype=...)` leaves them: the RoPE frequency buffers stay float32 (a plain
    `.to(dtype)` would round them too, and corrupt `model` for later float32 references)."""
    copy = model
    if dtype is not torch.float32:
        copy = copy_module.deepcopy(model)
        for parameter in copy.parameters():
            parameter.data = parameter.data.to(dtype)
    return copy.to(device=_DEVICE)


def _hf_logits(model, token_ids: list[int]) -> np.ndarray:
    """Float32 logits of every position from a model `_hf_model` prepared."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids], device=_DEVICE)).logits[0]
    return logits.float().cpu().numpy()


@pytest.mark.parametrize(
    "config", [LLAMA_3_2_1B, LLAMA_3_1_8B, QWEN3_0_6B], ids=["llama3.2-1b-4l", "llama3.1-8b-2l", "qwen3-0.6b-6l"]
)
def test_random_real_configs_match_transformers_within_its_own_bf16_error(config, cuda_backend, rng):
    reference, tensors = build_reference(config, seed=3)
    model_config = ModelConfig.from_dict(config)
    model = load_model(model_config, DictWeights(tensors), cuda_backend, max_positions=2048)
    spec = KvCacheSpec(model_config.num_layers, 129, BLOCK_SIZE, model_config.num_kv_heads, model_config.head_dim,
                       DType.BF16)
    worker = Worker(cuda_backend, model, (cuda_backend.attention.allocate_cache(spec),), WorkerConfig(1024, 8, 2048))
    prompts = [[int(t) for t in rng.integers(0, config["vocab_size"], size=n)] for n in (1, 17, 500)]
    free_blocks = list(rng.permutation(128))
    tables = []
    for prompt in prompts:
        count = -(-(len(prompt) + 1) // BLOCK_SIZE)
        tables.append(tuple(int(b) for b in free_blocks[:count]))
        free_blocks = free_blocks[count:]
    # step 1: three prefills in one batch; step 2: each decodes one more token; step 3: the first
    # decodes alone (one token row: the decode GEMVs)
    steps = [
        [(prompt, 0, len(prompt), table) for prompt, table in zip(prompts, tables)],
        [(prompt + [7], len(prompt), len(prompt) + 1, table) for prompt, table in zip(prompts, tables)],
        [(prompts[0] + [7, 9], len(prompts[0]) + 1, len(prompts[0]) + 2, tables[0])],
    ]
    exact_model, bf16_model = _hf_model(reference, torch.float32), _hf_model(reference, torch.bfloat16)
    for step_id, step in enumerate(steps):
        batch = ScheduledBatch(step_id, tuple(
            ScheduledSequence(f"s{i}", tuple(tokens[start:stop]), start, table, GREEDY)
            for i, (tokens, start, stop, table) in enumerate(step)
        ), BLOCK_SIZE)
        ours = worker.compute_logits(batch)
        for row, (tokens, _, stop, _) in enumerate(step):
            exact = _hf_logits(exact_model, tokens[:stop])[-1]
            hf_bf16 = _hf_logits(bf16_model, tokens[:stop])[-1]
            ours_error, hf_error = _relative(ours[row], exact), _relative(hf_bf16, exact)
            print(f"{config['model_type']} step {step_id} len {stop}: atlas {ours_error:.2e} transformers-bf16 {hf_error:.2e}")
            assert ours_error <= 1.5 * hf_error, (step_id, stop, ours_error, hf_error)


# How far past transformers' own bf16 error a cache dtype may take the logits: bf16 stays within
# it; FP8 E4M3 keeps 3 mantissa bits of every cached K and V value.
KV_ERROR_FACTOR = {DType.BF16: 1.5, DType.FP8_E4M3: 8.0}


@pytest.mark.parametrize("kv_dtype", [DType.BF16, DType.FP8_E4M3], ids=["bf16-kv", "fp8-kv"])
@pytest.mark.parametrize("num_seqs", [16, 64])
@pytest.mark.parametrize("config", [LLAMA_3_1_8B, LLAMA_3_2_1B], ids=["llama3.1-8b-2l", "llama3.2-1b-4l"])
def test_batched_decode_matches_transformers_within_its_own_bf16_error(config, num_seqs, kv_dtype, cuda_backend, rng):
    """A decode step of 16 or 64 sequences, past the GEMV sizes (cuBLASLt's products with the
    norms' RMS taken after them where the norms are folded, as at 8B; the norm kernels first at
    1B), eager and replayed from a captured graph (the same bits), against transformers; over a
    bf16 and an FP8 cache (scales 1, as for a checkpoint without any)."""
    reference, tensors = build_reference(config, seed=5)
    model_config = ModelConfig.from_dict(config)
    model = load_model(model_config, DictWeights(tensors), cuda_backend, max_positions=2048)
    blocks_per_seq = 2  # (the last block is the workers' scratch)
    spec = KvCacheSpec(model_config.num_layers, num_seqs * blocks_per_seq + 1, BLOCK_SIZE, model_config.num_kv_heads,
                       model_config.head_dim, kv_dtype)
    kv = cuda_backend.attention.allocate_cache(spec)
    eager_worker = Worker(cuda_backend, model, (kv,), WorkerConfig(2048, num_seqs, 2048))
    graph_worker = Worker(cuda_backend, model, (kv,), WorkerConfig(2048, num_seqs, 2048, graph_batch_sizes=(num_seqs,)))
    prompts = [[int(t) for t in rng.integers(0, config["vocab_size"], size=int(n))]
               for n in rng.integers(5, 2 * BLOCK_SIZE - 2, size=num_seqs)]
    tables = [tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]

    def step(worker: Worker, step_id: int, rows: list[tuple[list[int], int, int]]) -> np.ndarray:
        return worker.compute_logits(ScheduledBatch(step_id, tuple(
            ScheduledSequence(f"s{i}", tuple(tokens[start:stop]), start, tables[i], GREEDY)
            for i, (tokens, start, stop) in enumerate(rows)
        ), BLOCK_SIZE))

    step(eager_worker, 0, [(prompt, 0, len(prompt)) for prompt in prompts])
    decoded = [prompt + [7] for prompt in prompts]
    rows = [(tokens, len(tokens) - 1, len(tokens)) for tokens in decoded]
    eager = step(eager_worker, 1, rows)
    for step_id in (2, 3):  # captured at the first, replayed at both (the same K/V rows rewritten)
        np.testing.assert_array_equal(step(graph_worker, step_id, rows), eager)
    exact_model, bf16_model = _hf_model(reference, torch.float32), _hf_model(reference, torch.bfloat16)
    worst = 0.0
    for row, tokens in enumerate(decoded):
        exact, hf_bf16 = _hf_logits(exact_model, tokens)[-1], _hf_logits(bf16_model, tokens)[-1]
        ours_error, hf_error = _relative(eager[row], exact), _relative(hf_bf16, exact)
        worst = max(worst, ours_error / hf_error)
        assert ours_error <= KV_ERROR_FACTOR[kv_dtype] * hf_error, (row, len(tokens), ours_error, hf_error)
    print(f"{config['model_type']} {num_seqs} sequences, {kv_dtype.value} cache: "
          f"atlas error / transformers-bf16 error at most {worst:.2f}")


# The families loaded by qwen3_moe.py, qwen3_next.py (Qwen3.5-MoE too), gemma3.py and gpt_oss.py: real configs cut to
# a few layers (expert counts and sizes, head dims, GQA ratios, vocabularies, windows and RoPE are
# the real ones). Gemma 3 keeps six layers so its sixth is a full one, Qwen3-Next a Gated DeltaNet
# layer and a gated attention one; the references run transformers' eager attention (GPT-OSS's
# sinks have no SDPA path).
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
    initializer_range=0.02, attn_implementation="eager",
)
GEMMA_3_1B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
    intermediate_size=6912, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768, query_pre_attn_scalar=256,
    rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512,
    sliding_window_pattern=6, tie_word_embeddings=True, initializer_range=0.02, attn_implementation="eager",
)
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=2, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, layer_types=["sliding_attention", "full_attention"], sliding_window=128,
    attention_bias=True, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096),
    swiglu_limit=7.0, tie_word_embeddings=False, initializer_range=0.02, attn_implementation="eager",
)  # fmt: skip


QWEN3_NEXT_80B_A3B = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
    intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512,
    num_experts_per_tok=10, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"], num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
    tie_word_embeddings=False, initializer_range=0.02, attn_implementation="eager",
)  # fmt: skip
# Qwen3.5-MoE's layout (split DeltaNet projections, fused experts) at Qwen3-Next-80B-A3B's widths
QWEN3_5_MOE = {key: value for key, value in QWEN3_NEXT_80B_A3B.items() if key != "norm_topk_prob"} | dict(
    architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
)
FAMILIES = {"qwen3-30b-a3b-2l": QWEN3_30B_A3B, "qwen3-next-80b-a3b-2l": QWEN3_NEXT_80B_A3B,
            "qwen3.5-moe-next-widths-2l": QWEN3_5_MOE, "gemma3-1b-6l": GEMMA_3_1B, "gpt-oss-20b-2l": GPT_OSS_20B}


def _scheduled(model, index: int, tokens: list[int], start: int, stop: int, table: tuple[int, ...]):
    """Sequence `index`'s tokens [start, stop) with the same pages in every KV group of the
    model and state slot `index` in every recurrent group."""
    groups = model.cache_groups
    num_kv = len(kv_group_indices(groups))
    return ScheduledSequence(f"s{index}", tuple(tokens[start:stop]), start, table, GREEDY,
                             kv_block_tables=(BlockTable(table),) * num_kv,
                             state_slots=(index,) * (len(groups) - num_kv))


@dataclass(frozen=True, slots=True)
class RowError:
    """One sampled row against transformers float32: squared L2 norms of Atlas's and
    transformers bf16's differences from it, and of it."""

    step_id: int
    length: int
    atlas: float
    transformers_bf16: float
    reference: float


def relative_errors(rows: list[RowError]) -> tuple[float, float]:
    """(Atlas's, transformers bf16's) relative L2 error over `rows` together."""
    reference = sum(row.reference for row in rows)
    return (float(np.sqrt(sum(row.atlas for row in rows) / reference)),
            float(np.sqrt(sum(row.transformers_bf16 for row in rows) / reference)))


FAMILY_BATCH = 16  # the short prompts family_steps prefills and decodes together


def family_steps(config: dict, backend, rng, device: str = _DEVICE) -> list[RowError]:
    """Prefills of 1, 17 and 600 tokens in one batch (past the 128- and 512-token windows), a
    batched decode of each, a 300-token prompt in two chunks beside decodes (its state, where
    the model has one, carried from the first chunk), then FAMILY_BATCH short prompts prefilled
    together and decoded twice: every sampled row's errors (58 rows)."""
    reference, tensors = build_reference(config, seed=11, device=device)
    model = load_model(ModelConfig.from_dict(config), DictWeights(tensors), backend, max_positions=2048)
    worker = make_worker(model, 200, BLOCK_SIZE, WorkerConfig(1024, 32, 2048), backend.capabilities.activation_dtype)
    lengths = [1, 17, 600, 300, *(int(n) for n in rng.integers(2, 40, size=FAMILY_BATCH))]
    prompts = [[int(t) for t in rng.integers(0, config["vocab_size"], size=n)] for n in lengths]
    free_blocks = [int(b) for b in rng.permutation(200)]
    tables = []
    for prompt in prompts:
        count = -(-(len(prompt) + 3) // BLOCK_SIZE)
        tables.append(tuple(free_blocks[:count]))
        free_blocks = free_blocks[count:]
    decoded = [prompt + [7] for prompt in prompts]
    batch = range(4, 4 + FAMILY_BATCH)
    steps = [  # (sequence, tokens, start, stop) per row; every row samples
        [(i, prompts[i], 0, len(prompts[i])) for i in range(3)],
        [(i, decoded[i], len(decoded[i]) - 1, len(decoded[i])) for i in range(3)],
        [(0, decoded[0] + [9], len(decoded[0]), len(decoded[0]) + 1), (3, prompts[3], 0, 150)],
        [(2, decoded[2] + [9], len(decoded[2]), len(decoded[2]) + 1), (3, prompts[3], 150, 300)],
        [(i, prompts[i], 0, len(prompts[i])) for i in batch],
        [(i, decoded[i], len(decoded[i]) - 1, len(decoded[i])) for i in batch],
        [(i, decoded[i] + [9], len(decoded[i]), len(decoded[i]) + 1) for i in batch],
    ]
    exact_model, bf16_model = _hf_model(reference, torch.float32), _hf_model(reference, torch.bfloat16)
    errors = []
    for step_id, step in enumerate(steps):
        rows = tuple(_scheduled(model, i, tokens, start, stop, tables[i]) for i, tokens, start, stop in step)
        ours = np.asarray(worker.compute_logits(ScheduledBatch(step_id, rows, BLOCK_SIZE)), np.float64)
        for row, (_, tokens, _, stop) in enumerate(step):
            exact = np.asarray(_hf_logits(exact_model, tokens[:stop])[-1], np.float64)
            hf_bf16 = np.asarray(_hf_logits(bf16_model, tokens[:stop])[-1], np.float64)
            errors.append(RowError(step_id, stop, float(np.sum((ours[row] - exact) ** 2)),
                                   float(np.sum((hf_bf16 - exact) ** 2)), float(np.sum(exact**2))))
    return errors


@pytest.mark.parametrize("config", FAMILIES.values(), ids=FAMILIES.keys())
def test_families_prefill_decode_and_chunk_within_transformers_bf16_error(config, cuda_backend, rng):
    """The rows of `family_steps` (prefill batches, batched decodes, two chunked-prefill steps)
    together within 1.5x transformers' own bf16 error. Not row by row: a random router's top-k
    nearly ties for some tokens, where a bf16 port and transformers' bf16 each pick another
    expert now and then, that row's error then 3-10x the others' (the bf16 mock, an exact bf16
    port, lands at 2.6x on one Qwen3-30B-A3B row and 7.8x on one GPT-OSS row, 0.1-1x elsewhere);
    over many rows those flips weigh alike on both sides, while a broken path shows."""
    rows = family_steps(config, cuda_backend, rng)
    for step_id in sorted({row.step_id for row in rows}):
        step = [row for row in rows if row.step_id == step_id]
        atlas, hf = relative_errors(step)
        lengths = ",".join(str(row.length) for row in step)
        print(f"{config['model_type']} step {step_id} (lens {lengths}): atlas {atlas:.2e} transformers-bf16 {hf:.2e}")
    atlas, hf = relative_errors(rows)
    print(f"{config['model_type']} all steps: atlas {atlas:.2e} transformers-bf16 {hf:.2e}")
    assert atlas <= 1.5 * hf, (atlas, hf)


def _smollm2_dir() -> Path:
    folder = Path(os.environ.get("ATLAS_SMOLLM2_DIR", Path.home() / ".cache/atlas/models/smollm2"))
    if not (folder / "config.json").exists():
        pytest.skip("SmolLM2 is not here (set ATLAS_SMOLLM2_DIR)")
    return folder


_NEAR_TIE = 0.005  # relative logit gap under which greedy paths may part


def test_smollm2_greedy_on_cuda_equals_the_mock(kernel_cache_dir):
    """64 greedy tokens on 5 chat prompts, CUDA against the mock rounding like a GPU (bf16).

    Both round every activation to bf16 at the same points; they differ only in the order of
    float32 sums and in exp/rsqrt approximations. The fourth prompt passes a near-tie at its
    tenth token (four variants of the two backends chose four different tokens there, see
    scripts/smollm2_tokens.py; the tensor-core decode attention parts there too, at a 0.29% gap),
    and since the mock's prefill became tiled GEMMs the second and fourth part at 0.38% and 0.14%
    (H200). So paths may part only at a near-tie (the mock's best logit within `_NEAR_TIE` of
    CUDA's choice), and at least three prompts must agree throughout; both backends' best logits
    where the paths part are printed.
    """
    from atlas.app.llm import LLM

    folder = str(_smollm2_dir())
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=False)
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    cuda = LLM(folder, device="cuda", show_progress=False, max_seq_len=1024, kv_cache_gb=2)
    cuda_results = cuda.chat(conversations, params)
    on_cuda = [r.outputs[0].token_ids for r in cuda_results]
    mock = LLM(folder, device="mock", dtype="bf16", show_progress=False, max_seq_len=1024)
    on_mock = [r.outputs[0].token_ids for r in mock.chat(conversations, params)]
    parted, gaps = [], []
    for prompt, conversation, got, expected in zip(CHAT_PROMPTS, conversations, on_cuda, on_mock):
        print(f"{prompt!r}: cuda {len(got)} tokens, mock {len(expected)}, equal={got == expected}")
        if got != expected:
            gaps.append(_near_tie_where_paths_part(cuda, mock, conversation, got, expected))
            parted.append(f"{prompt!r} (the mock's best logit {gaps[-1]:.2%} above CUDA's choice)")
    assert len(parted) <= 2 and all(gap < _NEAR_TIE for gap in gaps), f"CUDA and the mock part on {parted}"
    # (not asked again: the probes above wrote their K/V over blocks the prefix cache holds)
    assert "Paris" in cuda_results[0].outputs[0].text


SMALL_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=256,
    intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
)


def _engine(backend, graph_sizes):
    from fakes import random_llama_weights

    from atlas.domain.engine import EngineCore
    from atlas.domain.cache.manager import CacheManager
    from atlas.domain.scheduler import Scheduler, SchedulerConfig

    config = ModelConfig.from_dict(SMALL_LLAMA)
    model = load_model(config, DictWeights(random_llama_weights(SMALL_LLAMA, seed=5, scale=0.1)), backend, 512)
    spec = KvCacheSpec(config.num_layers, 201, BLOCK_SIZE, config.num_kv_heads, config.head_dim, DType.BF16)
    worker = Worker(backend, model, (backend.attention.allocate_cache(spec),), WorkerConfig(256, 16, 512, graph_sizes))
    worker.capture_graphs()
    scheduler = Scheduler(SchedulerConfig(512, 16, 256, BLOCK_SIZE), CacheManager.for_groups(model.cache_groups, (200,), BLOCK_SIZE, True))
    return EngineCore(scheduler, worker, 512, 512, frozenset())


def test_graph_replay_with_device_side_tokens_matches_eager_logits(cuda_backend, rng):
    """The overlapped decode path: step 2's tokens are step 1's samples, read on the device,
    through a replayed graph padded to a bucket; an eager worker given the same tokens on the
    host must produce the same logits (to bf16 rounding)."""
    from atlas.domain.batch import SamplingRow

    def worker(graph_sizes):
        from fakes import random_llama_weights

        config = ModelConfig.from_dict(SMALL_LLAMA)
        model = load_model(config, DictWeights(random_llama_weights(SMALL_LLAMA, seed=5, scale=0.1)), cuda_backend, 512)
        spec = KvCacheSpec(config.num_layers, 101, BLOCK_SIZE, config.num_kv_heads, config.head_dim, DType.BF16)
        kv = cuda_backend.attention.allocate_cache(spec)
        return Worker(cuda_backend, model, (kv,), WorkerConfig(256, 16, 512, graph_sizes))

    graphed, eager = worker((4, 8, 16)), worker(())
    prompts = [tuple(int(t) for t in rng.integers(0, 512, size=int(n))) for n in rng.integers(2, 40, size=11)]
    rows = [SamplingRow(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0, seed=i, counter=0) for i in range(11)]
    tables = [tuple(range(6 * i, 6 * i + 6)) for i in range(11)]
    prefill = ScheduledBatch(0, tuple(
        ScheduledSequence(f"s{i}", p, 0, tables[i], rows[i]) for i, p in enumerate(prompts)), BLOCK_SIZE)
    pending = graphed.submit(prefill)
    decode_rows = [SamplingRow(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0, seed=i, counter=1) for i in range(11)]
    placeholder_decode = ScheduledBatch(1, tuple(
        ScheduledSequence(f"s{i}", (-1,), len(p), tables[i], decode_rows[i], placeholder_row=i)
        for i, p in enumerate(prompts)), BLOCK_SIZE)
    graphed_logits = graphed.compute_logits(placeholder_decode)  # before reading step 1's ids
    sampled = pending.result().token_ids
    assert eager.execute(prefill).token_ids == sampled  # same prefill, same seeds, same draws
    explicit_decode = ScheduledBatch(1, tuple(
        ScheduledSequence(f"s{i}", (sampled[i],), len(p), tables[i], decode_rows[i])
        for i, p in enumerate(prompts)), BLOCK_SIZE)
    eager_logits = eager.compute_logits(explicit_decode)
    assert graphed._graphs and not eager._graphs
    assert _relative(graphed_logits, eager_logits) < 1e-2


def test_the_engine_on_cuda_runs_overlapped_graphed_steps_to_completion(cuda_backend, rng):
    from atlas.domain.requests import Request

    mixes = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.9, top_p=0.8, max_tokens=20),
        SamplingParams(temperature=0.7, repetition_penalty=1.2, max_tokens=20, logprobs=3),
    ]
    requests = [
        Request(f"r{i}", tuple(int(t) for t in rng.integers(0, 512, size=int(rng.integers(2, 60)))), mixes[i % 3], 11 + i)
        for i in range(11)
    ]

    def run(core):
        tokens = {r.request_id: [] for r in requests}
        for request in requests:
            core.add_request(request)
        while core.has_unfinished:
            for output in core.step():
                tokens[output.seq_id].extend(output.new_token_ids)
        assert core.stats().num_blocks_free == 200
        return tokens

    first = run(_engine(cuda_backend, (1, 2, 4, 8, 16)))
    again = run(_engine(cuda_backend, (1, 2, 4, 8, 16)))
    assert first == again  # same kernels, same seeds: reproducible
    assert all(len(t) == 20 for t in first.values())


def _near_tie_where_paths_part(cuda, mock, conversation, got, expected) -> float:
    """Both backends' best logits where the greedy paths part; returns the mock's relative gap
    between its best token and the one CUDA chose."""
    index = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    prompt_ids = cuda.tokenizer.encode(cuda.render_chat(conversation), add_special_tokens=False)
    context = tuple(prompt_ids) + tuple(got[:index])
    gap = float("inf")
    for name, llm in (("cuda", cuda), ("mock", mock)):
        blocks = tuple(range(-(-len(context) // BLOCK_SIZE)))
        batch = ScheduledBatch(0, (ScheduledSequence("probe", context, 0, blocks, GREEDY),), BLOCK_SIZE)
        logits = llm.engine.core.executor.compute_logits(batch)[0]
        best = np.argsort(logits)[::-1][:3]
        print(f"  parts at output token {index}: {name} top-3 " + ", ".join(f"{t}={logits[t]:.4f}" for t in best))
        if name == "mock":
            gap = float((logits[best[0]] - logits[got[index]]) / abs(logits[best[0]]))
    return gap


# FP8 checkpoints: how far past transformers' own bf16 error (both against float32 transformers on
# the dequantized weights) Atlas's logits may be. Steps of at most 8 tokens run the decode GEMVs,
# which read the weights exactly and keep x in bf16: bf16's bound. Longer steps round each
# projection's input to E4M3 for the FP8 tensor cores (3 mantissa bits, ~2.5% of each product:
# ops_fp8.py). On the CPU (torch, the 8B cut with a 32000-token vocabulary, every projection's
# input rounded to E4M3 per token / per 128 columns) the last position's logits of a 17-token
# prompt were 6.6 / 6.4 times transformers-bf16's error from float32 (11.7% / 10.9% against
# 1.8%), and 0.9 / 0.8 times at 300 tokens, where bf16's own error is 15%. Per-channel products
# also accumulate without fp32 promotion (`fp8_fast_accum`): on an H200 the 8B cut's prefills went
# from 7.25 to 7.50 times transformers-bf16's error with it.
FP8_DECODE_FACTOR = 1.5
FP8_PREFILL_FACTOR = 12.0


@pytest.mark.parametrize(
    "config, layout",
    [(LLAMA_3_1_8B, "channel"), (LLAMA_3_1_8B, "block"), (LLAMA_3_2_1B, "channel")],
    ids=["llama3.1-8b-2l-channel", "llama3.1-8b-2l-block", "llama3.2-1b-4l-channel"],
)
def test_fp8_checkpoints_match_transformers_on_their_dequantized_weights(config, layout, cuda_backend, rng):
    """An FP8 checkpoint (llm-compressor's per-channel layout, or 128 x 128 blocks as Qwen3-FP8 and
    DeepSeek-V3 store them) against transformers given its dequantized weights: decode-sized
    steps (a prefill of 1 + 3 + 4 tokens, three decodes, one) within bf16's bound, prefills of
    17 and 500 tokens within E4M3 activations' bound."""
    from fp8_checkpoints import load_dequantized, quantize_checkpoint

    reference, tensors = build_reference(config, seed=3)
    stored, quantization_config, dequantized = quantize_checkpoint(tensors, layout)
    load_dequantized(reference, dequantized)
    model_config = ModelConfig.from_dict({**config, "quantization_config": quantization_config})
    model = load_model(model_config, DictWeights(stored), cuda_backend, max_positions=2048)
    spec = KvCacheSpec(model_config.num_layers, 129, BLOCK_SIZE, model_config.num_kv_heads, model_config.head_dim,
                       DType.BF16)
    worker = Worker(cuda_backend, model, (cuda_backend.attention.allocate_cache(spec),), WorkerConfig(1024, 8, 2048))
    exact_model, bf16_model = _hf_model(reference, torch.float32), _hf_model(reference, torch.bfloat16)
    free_blocks = [int(b) for b in rng.permutation(128)]

    def run(step_id: int, rows: list[tuple[list[int], int, int, tuple[int, ...]]], factor: float) -> float:
        batch = ScheduledBatch(step_id, tuple(
            ScheduledSequence(f"s{i}", tuple(tokens[start:stop]), start, table, GREEDY)
            for i, (tokens, start, stop, table) in enumerate(rows)
        ), BLOCK_SIZE)
        ours = worker.compute_logits(batch)
        worst = 0.0
        for row, (tokens, _, stop, _) in enumerate(rows):
            exact = _hf_logits(exact_model, tokens[:stop])[-1]
            ours_error = _relative(ours[row], exact)
            hf_error = _relative(_hf_logits(bf16_model, tokens[:stop])[-1], exact)
            worst = max(worst, ours_error / hf_error)
            assert ours_error <= factor * hf_error, (layout, step_id, stop, ours_error, hf_error)
        return worst

    def tables(prompts):
        nonlocal free_blocks
        result = []
        for prompt in prompts:
            count = -(-(len(prompt) + 2) // BLOCK_SIZE)
            result.append(tuple(free_blocks[:count]))
            free_blocks = free_blocks[count:]
        return result

    short = [[int(t) for t in rng.integers(0, config["vocab_size"], size=n)] for n in (1, 3, 4)]
    short_tables = tables(short)
    decode = run(0, [(p, 0, len(p), t) for p, t in zip(short, short_tables)], FP8_DECODE_FACTOR)
    decode = max(decode, run(1, [(p + [7], len(p), len(p) + 1, t) for p, t in zip(short, short_tables)],
                             FP8_DECODE_FACTOR))
    decode = max(decode, run(2, [(short[0] + [7, 9], len(short[0]) + 1, len(short[0]) + 2, short_tables[0])],
                             FP8_DECODE_FACTOR))
    long = [[int(t) for t in rng.integers(0, config["vocab_size"], size=n)] for n in (17, 500)]
    prefill = run(3, [(p, 0, len(p), t) for p, t in zip(long, tables(long))], FP8_PREFILL_FACTOR)
    print(f"{config['model_type']} {layout}: atlas error / transformers-bf16 error at most {decode:.2f} in decode-"
          f"sized steps, {prefill:.2f} in prefills")


@pytest.mark.parametrize("layout", ["block"])
def test_an_fp8_batch_decodes_the_same_from_its_graph(layout, cuda_backend, rng):
    """16 sequences decoding one step of an FP8 8B cut (the FP8 GEMM with E4M3 activations,
    cuBLASLt's scale pointers inside the graph): eager and replayed logits bit for bit, and
    within E4M3 activations' bound of transformers."""
    from fp8_checkpoints import load_dequantized, quantize_checkpoint

    config, num_seqs = LLAMA_3_1_8B, 16
    reference, tensors = build_reference(config, seed=5)
    stored, quantization_config, dequantized = quantize_checkpoint(tensors, layout)
    load_dequantized(reference, dequantized)
    model_config = ModelConfig.from_dict({**config, "quantization_config": quantization_config})
    model = load_model(model_config, DictWeights(stored), cuda_backend, max_positions=2048)
    spec = KvCacheSpec(model_config.num_layers, 2 * num_seqs + 1, BLOCK_SIZE, model_config.num_kv_heads,
                       model_config.head_dim, DType.BF16)
    kv = cuda_backend.attention.allocate_cache(spec)
    eager_worker = Worker(cuda_backend, model, (kv,), WorkerConfig(2048, num_seqs, 2048))
    graph_worker = Worker(cuda_backend, model, (kv,), WorkerConfig(2048, num_seqs, 2048, graph_batch_sizes=(num_seqs,)))
    prompts = [[int(t) for t in rng.integers(0, config["vocab_size"], size=int(n))]
               for n in rng.integers(5, 2 * BLOCK_SIZE - 2, size=num_seqs)]
    tables = [(2 * i, 2 * i + 1) for i in range(num_seqs)]

    def step(worker: Worker, step_id: int, rows: list[tuple[list[int], int, int]]) -> np.ndarray:
        return worker.compute_logits(ScheduledBatch(step_id, tuple(
            ScheduledSequence(f"s{i}", tuple(tokens[start:stop]), start, tables[i], GREEDY)
            for i, (tokens, start, stop) in enumerate(rows)
        ), BLOCK_SIZE))

    step(eager_worker, 0, [(prompt, 0, len(prompt)) for prompt in prompts])
    decoded = [prompt + [7] for prompt in prompts]
    rows = [(tokens, len(tokens) - 1, len(tokens)) for tokens in decoded]
    eager = step(eager_worker, 1, rows)
    for step_id in (2, 3):
        np.testing.assert_array_equal(step(graph_worker, step_id, rows), eager)
    exact_model, bf16_model = _hf_model(reference, torch.float32), _hf_model(reference, torch.bfloat16)
    for row, tokens in enumerate(decoded[:4]):
        exact = _hf_logits(exact_model, tokens)[-1]
        ours_error, hf_error = _relative(eager[row], exact), _relative(_hf_logits(bf16_model, tokens)[-1], exact)
        assert ours_error <= FP8_PREFILL_FACTOR * hf_error, (row, ours_error, hf_error)


def test_smollm2_quantized_at_load_computes_what_the_mock_does(kernel_cache_dir):
    """`--quantization fp8` on the real SmolLM2-135M (its projections quantized per channel as
    they load): CUDA and the mock (rounding activations to bf16 like a GPU) read the same E4M3
    bytes, and over a 6-token step (the decode GEMVs: x stays bf16) their logits differ no more
    than twice as much as the bf16 model's do, plus 1e-3."""
    from atlas.app.llm import LLM

    folder = str(_smollm2_dir())
    context = (1, 504, 3125, 314, 253, 2)
    batch = ScheduledBatch(0, (ScheduledSequence("probe", context, 0, (0,), GREEDY),), BLOCK_SIZE)
    gaps = {}
    for quantization in ("none", "fp8"):
        logits = []
        for device, dtype in (("cuda", "auto"), ("mock", "bf16")):
            llm = LLM(folder, device=device, dtype=dtype, show_progress=False, max_seq_len=256, kv_cache_gb=1,
                      quantization=quantization, enforce_eager=True)
            logits.append(llm.engine.core.executor.compute_logits(batch)[0])
        gaps[quantization] = _relative(logits[0], logits[1])
    print(f"SmolLM2 CUDA against the mock: bf16 {gaps['none']:.2e}, FP8 quantized at load {gaps['fp8']:.2e}")
    assert gaps["fp8"] <= 2 * gaps["none"] + 1e-3
