"""`--batch-invariant` on CUDA: a token row's bits do not depend on the other rows of its step.

Each decode-sized product (plain, residual add, the norm inside, folded, gated) and decode
attention run once over a step of several rows and once over each row alone; every row must come
out bit for bit the same. Then a random Llama greedy-decodes the same prompts with n-gram drafts
and without them in one engine: the tokens must be identical.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the unit tests' fakes

from cuda_harness import bf16, cuda_cache_with, paged_case, poisoned, upload_metadata  # noqa: E402
from fakes import DictWeights, random_llama_weights  # noqa: E402
from helpers.engines import make_cache, make_worker  # noqa: E402

from atlas.domain.engine import EngineCore  # noqa: E402
from atlas.domain.models.config import ModelConfig  # noqa: E402
from atlas.domain.models.families import load_model  # noqa: E402
from atlas.domain.requests import Request, SamplingParams  # noqa: E402
from atlas.domain.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from atlas.domain.speculative.config import SpeculativeConfig  # noqa: E402
from atlas.domain.speculative.policy import NoSpeculation, speculation_policy  # noqa: E402
from atlas.domain.worker import WorkerConfig  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402
from atlas.ports.kernels.attention import HeadLayout  # noqa: E402
from atlas.ports.kernels.dense import HostProjection  # noqa: E402
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm  # noqa: E402

pytestmark = pytest.mark.gpu

ROW_COUNTS = (8, 5, 2)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.fixture
def invariant(cuda_backend):
    """The session backend with `batch_invariant` on for one test (the ops read the flag per call)."""
    rt = cuda_backend.runtime
    saved = rt.features
    rt.features = replace(saved, batch_invariant=True)
    yield cuda_backend
    rt.features = saved


@pytest.mark.parametrize("width", [576, 1536, 4096])
@pytest.mark.parametrize("form", ["linear", "linear_f32", "add", "rmsnorm", "gated", "folded", "folded_gated"])
def test_each_row_of_a_product_is_the_row_computed_alone(invariant, rng, width, form):
    backend = invariant
    features = 1024
    gated = form.endswith("gated")
    x = bf16(rng.standard_normal((max(ROW_COUNTS), width)) * 2)
    weight = bf16(rng.standard_normal((2 * features if gated else features, width)) / math.sqrt(width))
    norm = bf16(rng.standard_normal(width) * 0.3 + 1)
    residual = bf16(rng.standard_normal((max(ROW_COUNTS), features)))
    cx, cw, cn = backend.upload(x, DType.BF16), backend.upload(weight, DType.BF16), backend.upload(norm, DType.BF16)
    if form.startswith("folded"):
        if not backend.fold_rmsnorm(cn, cw):
            pytest.skip(f"rows of {width} are normalised inside the GEMV, not folded")
        cn = None

    def run(part: slice):
        n = part.stop - part.start
        xs = cx.rows(part.start, part.stop)
        out = poisoned(backend, (n, features), DType.F32 if form == "linear_f32" else DType.BF16)
        normed = poisoned(backend, (n, width), DType.BF16)
        if form in ("linear", "linear_f32"):
            backend.linear(xs, cw, out)
        elif form == "add":
            out = backend.upload(residual[part], DType.BF16)
            backend.linear_add(xs, cw, out, poisoned(backend, (n, features), DType.BF16))
        elif gated:
            scratch = poisoned(backend, (n, 2 * features), DType.BF16)
            backend.rmsnorm_gated_linear(xs, cn, 1e-5, cw, Activation.SILU, out, normed, scratch)
        else:
            backend.rmsnorm_linear(xs, cn, 1e-5, cw, out, normed)
        return out

    for num_rows in ROW_COUNTS:
        together = backend.download(run(slice(0, num_rows)))
        alone = np.concatenate([backend.download(run(slice(i, i + 1))) for i in range(num_rows)])
        assert np.isfinite(together).all()
        np.testing.assert_array_equal(together.view(np.uint8), alone.view(np.uint8),
                                      err_msg=f"{form}, {num_rows} rows of width {width}")


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize("form", ["plain", "norm", "gated", "add"])
def test_each_row_of_an_fp8_product_is_the_row_computed_alone(invariant, rng, form, block):
    """E4M3 weights (`--quantization fp8` and FP8 checkpoints): one row takes the tensor-core
    GEMV as 2..8 rows do, and the norm kernel before it instead of the norm inside."""
    backend = invariant
    dense = backend.dense
    rows, inner = 1024, 4096
    gated = form == "gated"
    data = np.clip(rng.standard_normal((2 * rows if gated else rows, inner)) * 100, -448, 448).astype(E4M3)
    shape = (-(-data.shape[0] // 128), inner // 128) if block else (data.shape[0],)
    linear = HostLinear(data, None, rng.uniform(1e-4, 4e-4, shape).astype(np.float32), (128, 128) if block else None)
    norm = RmsNorm(bf16(1 + 0.3 * rng.standard_normal(inner)), 1e-5) if form in ("norm", "gated") else None
    prepared = dense.prepare(HostProjection(linear, norm, Activation.SILU if gated else None))
    x = backend.upload(bf16(rng.standard_normal((max(ROW_COUNTS), inner)) * 2), DType.BF16)
    residual = bf16(rng.standard_normal((max(ROW_COUNTS), rows)))

    def run(part: slice):
        xs = x.rows(part.start, part.stop)
        if form == "add":
            out = backend.upload(residual[part], DType.BF16)
            dense.project_add(xs, prepared, out)
        else:
            out = poisoned(backend, (part.stop - part.start, rows), DType.BF16)
            dense.project(xs, prepared, out)
        return out

    for num_rows in ROW_COUNTS:
        together = backend.download(run(slice(0, num_rows)))
        alone = np.concatenate([backend.download(run(slice(i, i + 1))) for i in range(num_rows)])
        assert np.isfinite(together.astype(np.float32)).all()
        np.testing.assert_array_equal(together.view(np.uint16), alone.view(np.uint16), err_msg=f"{form}, {num_rows}")


@pytest.mark.parametrize("heads", [HeadLayout(9, 3, 64), HeadLayout(32, 8, 128)], ids=["smollm2", "llama8b"])
def test_each_decode_row_attends_as_it_would_alone(invariant, rng, heads):
    """Verify-like rows (contexts one apart, around split boundaries) and unrelated ones: each
    row's attention over its context is the same bits in the step and alone, whatever split count
    the step's longest context brings."""
    backend = invariant
    lengths = [127, 128, 129, 130, 131, 700, 2049, 33]
    case = paged_case(rng, heads, context_lens=lengths, query_lens=[1] * len(lengths))
    kv = cuda_cache_with(backend, case)
    scale = heads.head_dim**-0.5

    def attend(case_part):
        meta = upload_metadata(backend, case_part)
        q = backend.upload(case_part.query, DType.BF16)
        out = poisoned(backend, (case_part.num_tokens, heads.q_size), DType.BF16)
        backend.paged_attention(q, kv, 0, meta, heads, scale, out)
        return backend.download(out)

    together = attend(case)
    for i, length in enumerate(lengths):
        alone = replace(case, context_lens=(length,), query_lens=(1,), query=case.query[i : i + 1],
                        positions=case.positions[i : i + 1], slot_mapping=case.slot_mapping[i : i + 1],
                        query_start_loc=np.array([0, 1], np.int32), seq_lens=case.seq_lens[i : i + 1],
                        block_tables=case.block_tables[i : i + 1])
        np.testing.assert_array_equal(together[i].view(np.uint16), attend(alone)[0].view(np.uint16),
                                      err_msg=f"row {i}, context {length}")


SMALL_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=576,
    intermediate_size=1536, num_hidden_layers=3, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
)
BLOCK_SIZE = 16


def test_greedy_output_with_ngram_drafts_is_the_output_without(invariant, rng):
    """One engine over a random SmolLM2-shaped Llama (CUDA graphs on), the same prompts greedy
    with the n-gram proposer (k = 4) and with speculation off: identical tokens, with drafts
    accepted and rejected along the way (random weights make near-ties common, where
    batch-dependent sums would part the paths). The prefix cache is off: with it the second run
    starts from the first run's cached blocks and prefills only each prompt's tail, through
    other products than the first run's whole-prompt GEMM (a GEMV up to 8 rows, else cuBLASLt's
    timed choice), so its KV of those rows may differ in the last bits and part the runs at a
    near-tie whatever the proposer does."""
    backend = invariant
    config = ModelConfig.from_dict(SMALL_LLAMA)
    model = load_model(config, DictWeights(random_llama_weights(SMALL_LLAMA, seed=11, scale=0.5)), backend, 1024)
    spec = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}')
    worker = make_worker(model, 300, BLOCK_SIZE, WorkerConfig(256, 8, 1024, (1, 2, 4, 5, 8)), kv_dtype=DType.BF16)
    worker.capture_graphs()
    policy = speculation_policy(spec)
    cache = make_cache(model, 300, BLOCK_SIZE, 8, prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(1024, 8, 256, BLOCK_SIZE), cache, speculation=policy)
    core = EngineCore(scheduler, worker, 1024, 64, frozenset({63}))
    prompts = []
    for _ in range(6):
        phrase = [int(t) for t in rng.integers(0, 63, size=int(rng.integers(6, 20)))]
        prompts.append(tuple(phrase * 4 + phrase[: len(phrase) // 2]))

    def run(tag: str) -> list[list[int]]:
        outputs = []
        for index, prompt in enumerate(prompts):  # batch 1, as the speculative bench's figure
            core.add_request(Request(f"{tag}{index}", prompt, SamplingParams(temperature=0.0, max_tokens=128), index))
            tokens: list[int] = []
            while core.has_unfinished:
                for output in core.step():
                    tokens.extend(output.new_token_ids)
            outputs.append(tokens)
        return outputs

    scheduler.speculation = NoSpeculation()
    plain = run("plain")
    scheduler.speculation = policy
    before = core.stats()
    drafted = run("spec")
    stats = core.stats()
    accepted = stats.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    drafts = stats.num_spec_draft_tokens - before.num_spec_draft_tokens
    assert 0 < accepted < drafts, (accepted, drafts)
    assert drafted == plain
