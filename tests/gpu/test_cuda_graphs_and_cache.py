"""Graph capture and replay equal eager execution (the worker's decode graphs, sampling
included); a warm start compiles no kernel."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from cuda_harness import (
    bf16,
    cuda_cache_with,
    cuda_test_backend,
    launched_symbols,
    paged_case,
    poisoned,
    rel_l2,
    sampling_tensors,
    upload_metadata,
)

from atlas.domain.batch import SamplingRow, ScheduledBatch, ScheduledSequence
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.families import load_model
from atlas.domain.sampling import pack_rows
from atlas.domain.worker import Worker, WorkerConfig
from atlas.ports.gpu import DType
from atlas.ports.kernels.attention import HeadLayout, KvCacheSpec
from atlas.ports.kernels.host_weights import Activation

pytestmark = pytest.mark.gpu


class _DecodeStep:
    """A miniature decode step over persistent buffers: embed, norm, project, attend, sample."""

    def __init__(self, backend, rng, case, vocab_size: int = 3000, hidden: int = 512) -> None:
        heads = case.heads
        self.backend = backend
        self.case = case
        self.token_ids = backend.upload(rng.integers(0, vocab_size, case.num_tokens, dtype=np.int32))
        self.table = backend.upload(bf16(rng.standard_normal((vocab_size, hidden))), DType.BF16)
        self.norm = backend.upload(bf16(rng.standard_normal(hidden) + 1), DType.BF16)
        self.q_proj = backend.upload(bf16(rng.standard_normal((heads.q_size, hidden)) / 20), DType.BF16)
        self.mlp = backend.upload(bf16(rng.standard_normal((2 * heads.q_size, heads.q_size)) / 20), DType.BF16)
        self.head = backend.upload(bf16(rng.standard_normal((vocab_size, heads.q_size)) / 20), DType.BF16)
        self.kv = cuda_cache_with(backend, case)
        self.meta = upload_metadata(backend, case)
        n = case.num_tokens
        self.hidden = backend.empty((n, hidden), DType.BF16)
        self.normed = backend.empty((n, hidden), DType.BF16)
        self.q = backend.empty((n, heads.q_size), DType.BF16)
        self.attended = backend.empty((n, heads.q_size), DType.BF16)
        self.gated = backend.empty((n, 2 * heads.q_size), DType.BF16)
        self.activated = backend.empty((n, heads.q_size), DType.BF16)
        self.logits = backend.empty((n, vocab_size), DType.F32)

    def run(self) -> None:
        b, heads = self.backend, self.case.heads
        b.embedding(self.token_ids, self.table, self.hidden)
        b.rmsnorm(self.hidden, self.norm, 1e-6, self.normed)
        b.linear(self.normed, self.q_proj, self.q)
        b.paged_attention(self.q, self.kv, 0, self.meta, heads, 1 / math.sqrt(heads.head_dim), self.attended)
        b.linear(self.attended, self.mlp, self.gated)
        b.act_mul(self.gated, Activation.SILU, self.activated)
        b.linear(self.activated, self.head, self.logits)


def test_graph_replay_equals_eager_and_follows_new_buffer_contents(cuda_backend, rng):
    heads = HeadLayout(8, 2, 128)
    case = paged_case(rng, heads, [700, 33, 1500, 64], [1, 1, 1, 1])
    step = _DecodeStep(cuda_backend, rng, case)
    step.run()  # eager warm-up: workspaces exist before capture
    eager = cuda_backend.download(step.logits)
    graph = cuda_backend.capture(step.run)
    cuda_backend.fill(step.logits, float("nan"))
    graph.replay()
    np.testing.assert_array_equal(cuda_backend.download(step.logits), eager)

    # New token ids and a longer context: replay reads the new contents.
    new_ids = rng.integers(0, 3000, case.num_tokens, dtype=np.int32)
    cuda_backend.copy_from_host(step.token_ids, new_ids)
    cuda_backend.copy_from_host(step.meta.seq_lens, case.seq_lens - 5)
    cuda_backend.fill(step.logits, float("nan"))
    graph.replay()
    replayed = cuda_backend.download(step.logits)
    step.run()
    np.testing.assert_array_equal(replayed, cuda_backend.download(step.logits))
    assert rel_l2(replayed, eager) > 1e-3  # it really computed something new


@pytest.mark.parametrize("early", [True, False])
def test_a_kernel_after_cublas_launches_early_in_a_graph_and_computes_the_same(cuda_backend, rng, early):
    """In a captured graph act_mul_rms, after cuBLASLt's gated product of a folded norm's input,
    launches once the product's blocks have all started (`launch_order_edges`,
    graphs.launch_after_start) and takes the RMS before its wait. The residual it reads is
    changed by a kernel of ours before the product, with new contents before every replay: each
    replay gives the eager bits, so the early launch waits where it must."""
    from dataclasses import replace

    n, inner, features = 64, 4096, 7168
    rt = cuda_backend.runtime
    saved = rt.features
    rt.features = replace(saved, launch_order_edges=early and saved.programmatic_launch)
    try:
        weight = cuda_backend.upload(bf16(rng.standard_normal((2 * features, inner)) / 64), DType.BF16)
        norm = cuda_backend.upload(bf16(rng.standard_normal(inner) / 4 + 1), DType.BF16)
        assert cuda_backend.fold_rmsnorm(norm, weight)
        unit = cuda_backend.upload(bf16(np.ones(inner)), DType.BF16)
        residual = cuda_backend.empty((n, inner), DType.BF16)
        delta = cuda_backend.upload(bf16(rng.standard_normal((n, inner))), DType.BF16)
        normed = cuda_backend.empty((n, inner), DType.BF16)
        scratch = cuda_backend.empty((n, 2 * features), DType.BF16)
        out = cuda_backend.empty((n, features), DType.BF16)

        def step() -> None:
            cuda_backend.add_rmsnorm(delta, residual, unit, 1e-5, normed)  # residual += delta (ours)
            cuda_backend.rmsnorm_gated_linear(residual, None, 1e-5, weight, Activation.SILU, out, normed, scratch)

        contents = [bf16(rng.standard_normal((n, inner)) * rng.uniform(0.1, 30, (n, 1))) for _ in range(3)]
        cuda_backend.copy_from_host(residual, contents[0])
        step()  # eager warm-up: cuBLASLt's plans are tuned before capture
        graph = cuda_backend.capture(step)
        assert (graph.early_launches > 0) == rt.features.launch_order_edges
        for content in contents:
            cuda_backend.copy_from_host(residual, content)
            cuda_backend.fill(out, float("nan"))
            graph.replay()
            replayed = cuda_backend.download(out)
            cuda_backend.copy_from_host(residual, content)
            step()
            np.testing.assert_array_equal(replayed, cuda_backend.download(out))
    finally:
        rt.features = saved


def test_capture_refuses_allocation_and_host_copies(cuda_backend):
    from atlas.adapters.cuda.runtime import CaptureError

    with pytest.raises(CaptureError, match="empty"):
        cuda_backend.capture(lambda: cuda_backend.empty((4,), DType.F32))
    # The stream is usable again after a failed capture.
    tensor = cuda_backend.upload(np.arange(4, dtype=np.float32))
    assert cuda_backend.download(tensor).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_warm_start_compiles_no_kernel(kernel_cache_dir, tmp_path, monkeypatch):
    from atlas.adapters import cuda

    if not cuda.available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setenv("ATLAS_PACKAGED_CUBINS", "0")  # NVRTC then the cache, not the package
    first = cuda.CudaGpuBackend(kernel_cache_dir=tmp_path)
    first.runtime.kernels.wait()
    modules = len(first.runtime.kernels.modules)
    assert len(first.runtime.kernels.compiler.stats.compiled) == modules
    first.close()
    second = cuda.CudaGpuBackend(kernel_cache_dir=tmp_path)
    second.runtime.kernels.wait()
    stats = second.runtime.kernels.compiler.stats
    assert stats.compiled == [] and len(stats.loaded_from_cache) == modules
    # The warm backend computes: a poisoned output gets written.
    out = poisoned(second, (2, 8), DType.F32)
    second.gather_rows(second.upload(np.eye(8, dtype=np.float32)), second.upload(np.array([3, 5], np.int32)), out)
    assert second.download(out).argmax(axis=1).tolist() == [3, 5]
    second.close()


def test_a_fresh_cache_loads_the_packaged_cubins_and_computes(tmp_path, monkeypatch):
    """The nvcc-built cubins shipped in the package (opt-in) serve a start with an empty cache."""
    from atlas.adapters import cuda

    monkeypatch.setenv("ATLAS_PACKAGED_CUBINS", "1")
    if not cuda.available():
        pytest.skip("no CUDA GPU")
    backend = cuda.CudaGpuBackend(kernel_cache_dir=tmp_path)
    backend.runtime.kernels.wait()
    stats = backend.runtime.kernels.compiler.stats
    if backend.runtime.kernels.compiler.packaged is None:
        backend.close()
        pytest.skip(f"no packaged cubins for {backend.runtime.arch} on this driver")
    assert stats.compiled == [] and len(stats.packaged) == len(backend.runtime.kernels.modules)
    out = poisoned(backend, (2, 8), DType.F32)
    backend.gather_rows(backend.upload(np.eye(8, dtype=np.float32)), backend.upload(np.array([3, 5], np.int32)), out)
    assert backend.download(out).argmax(axis=1).tolist() == [3, 5]
    backend.close()


def test_graph_keeps_its_workspace_after_an_eager_step_outgrows_it(cuda_backend, rng):
    """An outgrown workspace is retired, not freed: an earlier graph still writes to it."""
    rows = [SamplingRow(temperature=0.7, top_k=0, top_p=0.8, min_p=0.0, seed=11 + r, counter=r) for r in range(4)]
    logits = cuda_backend.upload(bf16(rng.standard_normal((4, 5000)) * 2), DType.BF16)
    params = sampling_tensors(cuda_backend, pack_rows(rows))
    ids = cuda_backend.empty((4,), DType.I32)
    cuda_backend.sample(logits, params, ids)
    expected = cuda_backend.download(ids)
    graph = cuda_backend.capture(lambda: cuda_backend.sample(logits, params, ids))

    wide_rows = [SamplingRow(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=r, counter=0) for r in range(64)]
    wide_logits = cuda_backend.upload(bf16(rng.standard_normal((64, 50000))), DType.BF16)
    cuda_backend.sample(
        wide_logits, sampling_tensors(cuda_backend, pack_rows(wide_rows)), cuda_backend.empty((64,), DType.I32)
    )
    bystander = poisoned(cuda_backend, (4 * 5000,), DType.F32)  # the old workspace's size class

    cuda_backend.fill(ids, -1)
    graph.replay()
    np.testing.assert_array_equal(cuda_backend.download(ids), expected)
    assert np.isnan(cuda_backend.download(bystander)).all()


def test_capture_without_warm_up_creates_the_workspaces_it_needs(kernel_cache_dir, rng):
    """A fresh backend captures a step whose ops need workspaces (split-K partials, the sampler's
    rows, a cuBLASLt plan) it never ran eagerly; replay equals the eager run afterwards."""
    from atlas.adapters import cuda

    if not cuda.available():
        pytest.skip("no CUDA GPU")
    backend = cuda_test_backend(kernel_cache_dir)
    heads = HeadLayout(16, 2, 128)
    case = paged_case(rng, heads, [3000, 2200], [1, 1])  # long contexts: split-K decode
    kv = cuda_cache_with(backend, case)
    meta = upload_metadata(backend, case)
    q = backend.upload(case.query, DType.BF16)
    attended = backend.empty((2, heads.q_size), DType.BF16)
    x16 = backend.upload(bf16(rng.standard_normal((16, 512))), DType.BF16)
    weight = backend.upload(bf16(rng.standard_normal((256, 512)) / 20), DType.BF16)
    projected = backend.empty((16, 256), DType.F32)
    logits = backend.upload(bf16(rng.standard_normal((3, 7000)) * 2), DType.BF16)
    rows = [SamplingRow(temperature=0.9, top_k=0, top_p=0.95, min_p=0.0, seed=5 + r, counter=2) for r in range(3)]
    params = sampling_tensors(backend, pack_rows(rows))
    ids = backend.empty((3,), DType.I32)

    def step() -> None:
        backend.paged_attention(q, kv, 0, meta, heads, 1 / math.sqrt(heads.head_dim), attended)
        backend.linear(x16, weight, projected)
        backend.sample(logits, params, ids)

    graph = backend.capture(step)
    for tensor in (attended, projected):
        backend.fill(tensor, float("nan"))
    backend.fill(ids, -1)
    graph.replay()
    replayed = [backend.download(t) for t in (attended, projected, ids)]
    step()
    eager = [backend.download(t) for t in (attended, projected, ids)]
    for a, b in zip(replayed, eager, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert np.isfinite(np.asarray(replayed[0], np.float64)).all() and (replayed[2] >= 0).all()
    backend.close()


DECODE_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}  # fmt: skip
DECODE_BLOCK_SIZE = 16
GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)


def _decode_worker(backend, graph_sizes: tuple[int, ...]) -> Worker:
    from fakes import DictWeights, random_llama_weights

    config = ModelConfig.from_dict(DECODE_LLAMA)
    model = load_model(config, DictWeights(random_llama_weights(DECODE_LLAMA, seed=3, scale=0.1)), backend, 128)
    spec = KvCacheSpec(config.num_layers, 17, DECODE_BLOCK_SIZE, config.num_kv_heads, config.head_dim, DType.BF16)
    return Worker(backend, model, (backend.attention.allocate_cache(spec),), WorkerConfig(128, 8, 128, graph_sizes))


def _eager_ids(backend, logits, rows: list[SamplingRow]) -> tuple[int, ...]:
    """What eager sampling picks from `logits` with `rows` uploaded afresh (not the worker's arena)."""
    ids = poisoned(backend, (len(rows),), DType.I32)
    backend.sample(logits, sampling_tensors(backend, pack_rows(rows)), ids)
    return tuple(int(t) for t in backend.download(ids))


def test_decode_graph_samples_as_eager_sampling_and_samples_again_for_bias_and_penalties(
    cuda_backend, rng, monkeypatch
):
    """A decode step padded to its bucket (5 rows in 8) is sampled inside the graph: greedy and
    seeded temperature/top-p/top-k rows get the ids eager sampling gives from the same logits,
    with no eager launch. A step with a logit bias and penalties samples again after the replay
    and gets the eager ids too."""
    worker = _decode_worker(cuda_backend, (8,))
    worker.capture_graphs()
    launches = []
    original_sample = cuda_backend.sampling.sample
    monkeypatch.setattr(cuda_backend.sampling, "sample", lambda *args: (launches.append(1), original_sample(*args))[1])

    prompts = [tuple(int(t) for t in rng.integers(0, 512, size=int(n))) for n in (5, 12, 20, 27, 9)]
    tables = [(2 * i, 2 * i + 1) for i in range(len(prompts))]  # 32 tokens each; block 16 is scratch
    prefill = ScheduledBatch(
        0, tuple(ScheduledSequence(f"s{i}", p, 0, tables[i], GREEDY) for i, p in enumerate(prompts)), DECODE_BLOCK_SIZE
    )

    def decode(step_id: int, new_tokens: tuple[int, ...], rows: list[SamplingRow]) -> ScheduledBatch:
        sequences = tuple(
            ScheduledSequence(f"s{i}", (new_tokens[i],), len(prompt) + step_id - 1, tables[i], rows[i])
            for i, prompt in enumerate(prompts)
        )
        return ScheduledBatch(step_id, sequences, DECODE_BLOCK_SIZE)

    prefilled = worker.execute(prefill).token_ids
    assert len(launches) == 1  # a prefill is an eager step

    plain_rows = [
        GREEDY,
        SamplingRow(temperature=0.9, top_k=0, top_p=0.8, min_p=0.0, seed=101, counter=1),
        SamplingRow(temperature=1.1, top_k=0, top_p=0.95, min_p=0.0, seed=2**64 - 7, counter=1),
        SamplingRow(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=103, counter=1),
        GREEDY,
    ]
    launches.clear()
    first = worker.execute(decode(1, prefilled, plain_rows)).token_ids
    assert launches == []  # sampled inside the graph
    logits = worker._graphs[8][1].rows(0, len(prompts))
    assert first == _eager_ids(cuda_backend, logits, plain_rows)

    favoured = int(rng.integers(0, 512))
    context = prompts[1] + (prefilled[1], first[1])
    counts = {token: context[len(prompts[1]) :].count(token) for token in dict.fromkeys(context)}
    processed_rows = [
        SamplingRow(
            temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0,
            bias_token_ids=(favoured,), bias_values=(100.0,),
        ),
        SamplingRow(
            temperature=0.8, top_k=0, top_p=0.9, min_p=0.0, seed=101, counter=2,
            repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5,
            penalty_token_ids=tuple(counts), penalty_output_counts=tuple(counts.values()),
        ),
        SamplingRow(temperature=1.1, top_k=0, top_p=0.95, min_p=0.0, seed=2**64 - 7, counter=2),
        SamplingRow(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=103, counter=2),
        GREEDY,
    ]  # fmt: skip
    launches.clear()
    second = worker.execute(decode(2, first, processed_rows)).token_ids
    assert len(launches) == 1  # sampled again after the replay
    logits = worker._graphs[8][1].rows(0, len(prompts))
    assert second == _eager_ids(cuda_backend, logits, processed_rows)
    assert second[0] == favoured  # the bias applied: the eager ids replaced the graph's


def test_closing_an_llm_gives_its_device_memory_back(kernel_cache_dir, tmp_path):
    """Each LLM takes 90% of the device for its KV cache by default; close() frees the weights,
    caches and buffers even though the LLM object lives on, so a second LLM loads in the same
    process and generates (before, it found about 10% free and refused to load)."""
    pytest.importorskip("transformers")
    from tiny_models import write_model_folder

    from atlas.app.llm import LLM
    from atlas.domain.requests import SamplingParams

    write_model_folder(tmp_path, "llama3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, num_hidden_layers=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = LLM(str(tmp_path), device="cuda", show_progress=False, max_seq_len=256)
    backend = first.engine.backend
    free_loaded, total = backend.memory_info()
    expected = first.generate("the quick brown fox", params)[0].outputs[0].token_ids
    first.close()
    free_closed, _ = backend.memory_info()
    assert free_loaded < 0.2 * total and free_closed > 0.8 * total, (free_loaded, free_closed, total)
    second = LLM(str(tmp_path), device="cuda", show_progress=False, max_seq_len=256)
    assert second.generate("the quick brown fox", params)[0].outputs[0].token_ids == expected
    second.close()


_NEVER_CLOSED = """
import sys
from atlas.app.bench.tiny_model import TinyModelShape, write_tiny_model
from atlas.app.builder import build_engine
from atlas.app.long_running import freeze_startup_objects
from atlas.app.settings import EngineSettings
from atlas.domain.requests import Request, SamplingParams
path = write_tiny_model(sys.argv[1], shape=TinyModelShape(hidden_size=256, intermediate_size=512))
engine = build_engine(EngineSettings(model=str(path), device="cuda", max_seq_len=256, kv_cache_gb=0.25),
                      show_progress=False)
freeze_startup_objects()
for i in range(4):
    engine.core.add_request(Request(f"r{i}", (1, 2, 3, 4), SamplingParams(max_tokens=16, temperature=0.0), seed=i))
while engine.core.has_unfinished:
    engine.core.step()
"""


def test_an_engine_never_closed_exits_without_a_traceback(kernel_cache_dir, tmp_path):
    """Graphs still alive at interpreter exit (a script that never closes its engine) are
    destroyed quietly: once, 22 "Exception ignored" tracebacks, the driver module gone first."""
    env = {**os.environ, "ATLAS_KERNEL_CACHE": str(kernel_cache_dir)}
    done = subprocess.run([sys.executable, "-c", _NEVER_CLOSED, str(tmp_path / "tiny")], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]


SHARED_LLAMA = {**DECODE_LLAMA, "max_position_embeddings": 1024}


def test_decode_rows_over_a_shared_prompt_read_it_once_in_graphs_and_eagerly(cuda_backend, rng, monkeypatch):
    """Ten sequences continue one cached 320-token prompt (its 20 pages in each table): their
    decode step names the prefix, runs the cascade kernels (graphed: the bucket's shared-prefix
    variant, captured on first use) and gives the logits the plain kernels give. (The model is
    too small for the prefix to save the bytes the rule asks for; the test lifts that bar.)"""
    from dataclasses import replace

    from fakes import DictWeights, random_llama_weights

    from atlas.domain import step_inputs

    monkeypatch.setattr(step_inputs, "SHARED_PREFIX_MIN_SAVED_BYTES", 0)

    config = ModelConfig.from_dict(SHARED_LLAMA)
    model = load_model(config, DictWeights(random_llama_weights(SHARED_LLAMA, seed=4, scale=0.1)), cuda_backend, 512)
    spec = KvCacheSpec(config.num_layers, 40, DECODE_BLOCK_SIZE, config.num_kv_heads, config.head_dim, DType.BF16)
    cache = (cuda_backend.attention.allocate_cache(spec),)
    prompt = tuple(int(t) for t in rng.integers(0, 512, size=320))
    shared = tuple(range(20))
    Worker(cuda_backend, model, cache, WorkerConfig(512, 16, 512)).execute(
        ScheduledBatch(0, (ScheduledSequence("p", prompt, 0, shared, None),), DECODE_BLOCK_SIZE))
    owns = [tuple(int(t) for t in rng.integers(0, 512, size=2 + i)) for i in range(10)]
    chunks = ScheduledBatch(1, tuple(
        ScheduledSequence(f"s{i}", own, 320, shared + (20 + i,), GREEDY) for i, own in enumerate(owns)),
        DECODE_BLOCK_SIZE)
    first = Worker(cuda_backend, model, cache, WorkerConfig(512, 16, 512)).execute(chunks).token_ids
    decode = ScheduledBatch(2, tuple(
        ScheduledSequence(f"s{i}", (first[i],), 320 + len(own), shared + (20 + i,), GREEDY)
        for i, own in enumerate(owns)), DECODE_BLOCK_SIZE)

    rt = cuda_backend.runtime
    saved = rt.features
    logits = {}
    try:
        for name, graphs, cascade in (("graph", (16,), True), ("eager", (), True), ("plain", (16,), False)):
            rt.features = replace(saved, cascade_attention=cascade)
            worker = Worker(cuda_backend, model, cache, WorkerConfig(512, 16, 512, graphs))
            symbols = launched_symbols(
                cuda_backend, lambda: logits.__setitem__(name, worker.compute_logits(decode)))  # noqa: B023
            if name == "graph":
                assert 16 in worker._shared_prefix_graphs and 16 not in worker._graphs
            if name == "eager":
                assert "attention_cascade_d64" in symbols
    finally:
        rt.features = saved
    assert rel_l2(logits["graph"], logits["plain"]) < 1e-2
    assert rel_l2(logits["eager"], logits["plain"]) < 1e-2


def test_prompt_steps_replay_the_layers_pieces_as_eager_steps_compute(cuda_backend, rng):
    """A step with prompt tokens, padded to its bucket and replayed as the layers' captured
    pieces with attention launched between them for its own sequences, gives the eager step's
    logits: two prompts alone, then a decode row beside a new prompt. Once captured, a replay
    launches none of the layers' own kernels but attention."""
    from fakes import DictWeights, random_llama_weights

    config = ModelConfig.from_dict(SHARED_LLAMA)
    model = load_model(config, DictWeights(random_llama_weights(SHARED_LLAMA, seed=5, scale=0.1)), cuda_backend, 512)
    spec = KvCacheSpec(config.num_layers, 40, DECODE_BLOCK_SIZE, config.num_kv_heads, config.head_dim, DType.BF16)
    cache = (cuda_backend.attention.allocate_cache(spec),)
    eager = Worker(cuda_backend, model, cache, WorkerConfig(512, 16, 512))
    pieces = Worker(cuda_backend, model, cache, WorkerConfig(512, 16, 512, piece_max_tokens=512))
    assert pieces.piece_buckets and not eager.piece_buckets
    a, b, c = (tuple(int(t) for t in rng.integers(0, 512, size=n)) for n in (37, 70, 20))
    prompts = ScheduledBatch(0, (
        ScheduledSequence("a", a, 0, (0, 1, 2), GREEDY), ScheduledSequence("b", b, 0, (3, 4, 5, 6, 7), GREEDY),
    ), DECODE_BLOCK_SIZE)  # fmt: skip
    mixed = ScheduledBatch(1, (
        ScheduledSequence("a", (7,), 37, (0, 1, 2), GREEDY), ScheduledSequence("c", c, 0, (8, 9), GREEDY),
    ), DECODE_BLOCK_SIZE)  # fmt: skip
    for batch, rows in ((prompts, 112), (mixed, 32)):
        reference = eager.compute_logits(batch)
        replayed = pieces.compute_logits(batch)  # captures the bucket's pieces first
        assert rows in pieces._pieces
        assert rel_l2(replayed, reference) < 1e-2
        symbols = launched_symbols(cuda_backend, lambda: pieces.compute_logits(batch))  # noqa: B023
        assert not any(symbol.startswith("rope_and_cache") for symbol in symbols), symbols  # inside the pieces
        assert any(symbol.startswith("attention_") for symbol in symbols), symbols


@pytest.mark.parametrize("head_dim, kv_dtype", [(64, DType.BF16), (128, DType.BF16), (128, DType.FP8_E4M3)])
def test_a_lone_prompt_step_replays_its_layers_whole_as_the_pieces_compute(cuda_backend, rng, head_dim, kv_dtype):
    """A lone sequence's prompt step over a short context (a fresh prompt, then more tokens
    after it as a cached prefix) replays the layers captured whole, attention inside, launched
    over the bucket's rows: its logits are the pieces' bit for bit (each attention tile computes
    the same rows; the tiles past the sequence leave) and near the eager step's, and a replay
    launches no kernel of its own."""
    from dataclasses import replace

    from fakes import DictWeights, random_llama_weights

    shape = {**SHARED_LLAMA, "head_dim": head_dim}
    config = ModelConfig.from_dict(shape)
    model = load_model(config, DictWeights(random_llama_weights(shape, seed=5, scale=0.1)), cuda_backend, 512)
    spec = KvCacheSpec(config.num_layers, 40, DECODE_BLOCK_SIZE, config.num_kv_heads, config.head_dim, kv_dtype)
    cache = (cuda_backend.attention.allocate_cache(spec),)
    eager = Worker(cuda_backend, model, cache, WorkerConfig(512, 16, 512))
    whole = Worker(cuda_backend, model, cache, WorkerConfig(512, 16, 512, piece_max_tokens=512))
    assert cuda_backend.capabilities.whole_prompt_keys > 48
    saved = cuda_backend._capabilities
    try:  # what ATLAS_CUDA_DISABLE=whole_prompts gives
        cuda_backend._capabilities = replace(saved, whole_prompt_keys=0)
        pieces = Worker(cuda_backend, model, cache, WorkerConfig(512, 16, 512, piece_max_tokens=512))
    finally:
        cuda_backend._capabilities = saved
    a, tail = (tuple(int(t) for t in rng.integers(0, 512, size=n)) for n in (37, 9))
    fresh = ScheduledBatch(0, (ScheduledSequence("a", a, 0, (0, 1, 2), GREEDY),), DECODE_BLOCK_SIZE)
    after = ScheduledBatch(1, (ScheduledSequence("a", tail, 37, (0, 1, 2, 3), GREEDY),), DECODE_BLOCK_SIZE)
    for batch, rows in ((fresh, 48), (after, 16)):
        reference = eager.compute_logits(batch)
        by_pieces = pieces.compute_logits(batch)
        replayed = whole.compute_logits(batch)  # captures the bucket's layers whole first
        assert rows in whole._whole and rows not in whole._pieces and rows in pieces._pieces
        np.testing.assert_array_equal(replayed, by_pieces)
        assert rel_l2(replayed, reference) < 1e-2
        symbols = launched_symbols(cuda_backend, lambda: whole.compute_logits(batch))  # noqa: B023
        assert not any(symbol.startswith("attention_") for symbol in symbols), symbols
