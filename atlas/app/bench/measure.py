"""The measurements behind `atlas bench engine`, each on a loaded engine (no HTTP).

Every figure is host wall time around device work that is synchronised at both ends and
repeated enough to dwarf the clock; the device ceilings (copy bandwidth, bf16 GEMM rate) are
measured in the same process, so ratios compare like with like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from atlas.app.builder import LoadedEngine
from atlas.domain.batch import ScheduledBatch
from atlas.domain.models.config import ModelConfig
from atlas.domain.requests import Request, SamplingParams
from atlas.ports.gpu import DType, GpuBackend
from atlas.ports.kernels.dense import HostProjection
from atlas.ports.kernels.host_weights import HostLinear

GB = 1e9


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_bytes_per_s: float  # read + write of a large device-to-device copy
    gemm_flops_per_s: float  # bf16 [n, n] x [n, n]


@dataclass(frozen=True, slots=True)
class BytesRead:
    """What a decode step reads on the device that bounds it (on several ranks: the busiest
    rank's part): every weight once but the routed experts, the routed experts the step's tokens
    pick, the KV of each token of context, and each sequence's recurrent state, read and written.

    The experts a step touches: each MoE layer's share 1 - (1 - k/E)^batch of its E experts,
    the expected share under uniform routing. Exact at batch 1 (a token's k experts are distinct);
    past it an upper bound of the expected bytes (uneven routing touches fewer experts), so the
    roofline fraction of a large batch may flatter by a few percent."""

    weight_bytes: int  # every weight once, the routed experts aside
    kv_bytes_per_token: int
    expert_bytes: int = 0  # every routed expert of every MoE layer
    num_experts: int = 0
    top_k: int = 0
    state_bytes_per_sequence: int = 0  # recurrent state (conv + delta rule) read plus written

    def experts_read(self, batch: int) -> float:
        """Bytes of the routed experts `batch` tokens are expected to touch."""
        if not self.num_experts:
            return 0.0
        return self.expert_bytes * (1.0 - (1.0 - self.top_k / self.num_experts) ** batch)

    def step_bytes(self, batch: int, context_tokens: float) -> float:
        """Bytes a decode step of `batch` sequences with `context_tokens` of context in all reads."""
        return (self.weight_bytes + self.experts_read(batch) + context_tokens * self.kv_bytes_per_token
                + batch * self.state_bytes_per_sequence)


@dataclass(frozen=True, slots=True)
class DecodeResult:
    batch: int
    context_len: int
    mean_context: float  # the timed steps' mean context (their KV read), centred on context_len
    steps: int
    step_s: float  # engine step, host included (steps overlap)
    device_step_s: float  # the same step replayed back to back: device time alone
    roofline_step_s: float  # `BytesRead.step_bytes` / copy bandwidth

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def roofline_fraction(self) -> float:
        return self.roofline_step_s / self.step_s

    @property
    def host_gap_fraction(self) -> float:
        return max(self.step_s - self.device_step_s, 0.0) / self.step_s


@dataclass(frozen=True, slots=True)
class PrefillResult:
    num_tokens: int
    seconds: float  # request in -> first token out (the TTFT of a lone prompt)
    flops: float  # 2 x params x tokens + causal attention (the count)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


_PROBE_SHARE = 0.8  # of the free memory the probes may take (allocator rounding, the runtime's own)
_MIN_COPY_BYTES = 128 << 20  # still well past L2 (50 MB on an H100 or H200)


def measure_ceilings(backend: GpuBackend, copy_bytes: int, gemm_size: int, repeats: int = 10) -> Ceilings:
    """Copy bandwidth (gather_rows over `copy_bytes`, counting read + write) and GEMM rate.

    The engine is loaded by then and its KV cache holds most of the device (all but 5% with
    --gpu-memory-utilization 0.95), so each probe shrinks to what is free: the copy (a source
    and a target) to 80% of it, at least 128 MB; the GEMM (x, weight, out) by halving its size."""
    rng = np.random.default_rng(0)
    budget = int(backend.memory_info()[0] * _PROBE_SHARE)
    copy_bytes = max(min(copy_bytes, budget // 2), _MIN_COPY_BYTES)
    while gemm_size > 1024 and 3 * gemm_size * gemm_size * 2 > budget:
        gemm_size //= 2
    return Ceilings(_copy_rate(backend, rng, copy_bytes, repeats), _gemm_rate(backend, rng, gemm_size, repeats))


def _copy_rate(backend: GpuBackend, rng: np.random.Generator, copy_bytes: int, repeats: int) -> float:
    width = 16384
    rows = max(copy_bytes // (width * 2), 1)
    # random values (never zeros), tiled from a smaller draw so gigabytes take no time to make
    values = np.resize(rng.standard_normal(1 << 22, dtype=np.float32), rows * width).reshape(rows, width)
    source = backend.upload(values, DType.BF16)
    target = backend.empty((rows, width), DType.BF16)
    indices = backend.upload(np.arange(rows, dtype=np.int32))
    seconds = _time(backend, lambda: backend.gather_rows(source, indices, target), repeats)
    return 2 * rows * width * 2 / seconds


def _gemm_rate(backend: GpuBackend, rng: np.random.Generator, size: int, repeats: int) -> float:
    x = backend.upload(rng.standard_normal((size, size), dtype=np.float32), DType.BF16)
    weight = HostLinear(rng.standard_normal((size, size), dtype=np.float32) * 0.02)
    projection = backend.dense.prepare(HostProjection(weight))
    out = backend.empty((size, size), DType.BF16)
    return 2 * size**3 / _time(backend, lambda: backend.dense.project(x, projection, out), repeats)


def _time(backend: GpuBackend, fn, repeats: int) -> float:
    fn()
    backend.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    backend.synchronize()
    return (time.perf_counter() - started) / repeats


def weight_bytes_per_step(engine: LoadedEngine) -> int:
    """Bytes of weights a decode step reads: every matrix once as the device holds it (FP8
    projections a byte an element with their scales, the bf16 LM head two), the embedding only if
    tied, where it doubles as the LM head; norms included, embedding-row lookups neglected."""
    config = engine.config
    embedding_bytes = 2 * config.vocab_size * config.hidden_size
    total = engine.weight_bytes
    return total if config.tie_word_embeddings else total - embedding_bytes


def kv_bytes_per_token(engine: LoadedEngine) -> int:
    """K and V bytes a token of context costs a decode step: those of every attention layer (one
    of a sliding window reads at most its window; counted in full here)."""
    caches = engine.core.executor.caches
    return sum(
        cache.spec.bytes_per_block // cache.spec.block_size
        for group, cache in zip(engine.model.cache_groups, caches, strict=True)
        if group.kind.is_kv
    )


def routed_expert_bytes(config: ModelConfig) -> int:
    """Bytes of every routed expert's gate, up and down rows, bf16 (as the MoE kinds hold them;
    a shared expert is an ordinary weight), over the MoE layers."""
    per_layer = config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size * 2
    return per_layer * sum(config.is_moe_layer(layer) for layer in range(config.num_layers))


def state_bytes_per_sequence(engine: LoadedEngine) -> int:
    """Recurrent-state bytes a decode step reads and writes per sequence: its slot of every
    recurrent group, twice."""
    caches = engine.core.executor.caches
    return 2 * sum(
        cache.spec.bytes_per_slot
        for group, cache in zip(engine.model.cache_groups, caches, strict=True)
        if not group.kind.is_kv
    )


def engine_bytes_read(engine: LoadedEngine) -> BytesRead:
    """The bytes a decode step of a one-device engine reads."""
    config = engine.config
    experts = engine.expert_bytes or routed_expert_bytes(config)
    return BytesRead(weight_bytes_per_step(engine) - experts, kv_bytes_per_token(engine), experts,
                     config.num_experts, config.num_experts_per_tok, state_bytes_per_sequence(engine))


def measure_decode(engine: LoadedEngine, batch: int, context_len: int, decode_tokens: int,
                   bandwidth: float, seed: int = 0, bytes_read: BytesRead | None = None) -> DecodeResult:
    """`batch` sequences decoding `decode_tokens` timed steps (none finishes inside the window;
    all are aborted after it) at a context of `context_len`: the prompts are shorter by half the
    window (and the first token and a warm-up step), so the timed steps' contexts centre on
    `context_len` instead of all lying past it.

    The roofline counts the KV bytes each timed step really reads (the contexts it scheduled);
    `bytes_read` defaults to the one-device engine's (`engine_bytes_read`).
    """
    bytes_read = bytes_read or engine_bytes_read(engine)
    core, worker = engine.core, engine.core.executor
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    # generous: sequences that finished prefilling first keep decoding until the window closes
    params = SamplingParams(temperature=0.0, max_tokens=4 * decode_tokens + 64, ignore_eos=True)
    request_ids = [f"decode-{batch}-{seed}-{index}" for index in range(batch)]
    # A step's context counts its own token: the two steps before the window read prompt + 1 and
    # + 2, timed step j prompt + 3 + j, so the window's mean is context_len (+ 0.5 for even counts).
    prompt_len = max(1, context_len - (decode_tokens + 5) // 2)
    for index, request_id in enumerate(request_ids):
        prompt = tuple(int(t) for t in rng.integers(0, vocab, size=prompt_len))
        core.add_request(Request(request_id, prompt, params, seed=index))
    seen: set[str] = set()
    while len(seen) < batch:  # prefill until every sequence has its first token
        seen.update(o.seq_id for o in core.step())
    recorded: list[ScheduledBatch] = []
    original_submit = worker.submit

    def recording_submit(step_batch: ScheduledBatch, before_launch=None):
        recorded.append(step_batch)
        return original_submit(step_batch, before_launch)

    worker.submit = recording_submit
    try:
        core.step()  # the first step after prefill may still hold a prefill's commit
        recorded.clear()
        started = time.perf_counter()
        for _ in range(decode_tokens):
            core.step()
        step_s = (time.perf_counter() - started) / decode_tokens
    finally:
        del worker.submit
    for request_id in request_ids:
        core.abort(request_id)
    while core.has_unfinished:
        core.step()
    decoding = [b for b in recorded if len(b.sequences) == batch and b.num_tokens == batch]
    if len(decoding) != len(recorded):
        raise RuntimeError(f"batch {batch}: {len(recorded) - len(decoding)} timed steps were not full decode steps")
    device_step_s = replay_device_time(engine, decoding[len(decoding) // 2])
    mean_context = np.mean([sum(s.context_len for s in b.sequences) for b in decoding])
    read_bytes = bytes_read.step_bytes(batch, mean_context)
    return DecodeResult(batch, context_len, float(mean_context) / batch, decode_tokens, step_s, device_step_s,
                        read_bytes / bandwidth)


def replay_device_time(engine: LoadedEngine, batch: ScheduledBatch, repeats: int = 30) -> float:
    """Submit one recorded step (a decode or a verify step) back to back: the host enqueues
    faster than the device runs, so the time per step is the device's (graph replay + sampling
    + the id copy)."""
    worker = engine.core.executor
    worker.submit(batch).result()
    started = time.perf_counter()
    pending = [worker.submit(batch) for _ in range(repeats)]
    pending[-1].result()
    return (time.perf_counter() - started) / repeats


def prefill_flops(engine: LoadedEngine, num_tokens: int) -> float:
    """2 FLOPs a parameter a token (a routed expert's only for the k tokens in E that pick it)
    plus causal attention's."""
    config = engine.config
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * num_tokens * (num_tokens + 1) / 2
    parameters = config.num_parameters()
    if config.num_experts:
        parameters -= routed_expert_bytes(config) // 2 * (1 - config.num_experts_per_tok / config.num_experts)
    return 2 * parameters * num_tokens + attention


def measure_prefill(engine: LoadedEngine, num_tokens: int, repeats: int = 2) -> PrefillResult:
    """One prompt of `num_tokens` in one step (the budget must allow it): request in, first token out."""
    core = engine.core
    rng = np.random.default_rng(num_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    best = float("inf")
    for attempt in range(repeats + 1):  # the first run warms up (lazy workspaces, autotuning)
        prompt = tuple(int(t) for t in rng.integers(0, engine.config.vocab_size, size=num_tokens))
        started = time.perf_counter()
        core.add_request(Request(f"prefill-{num_tokens}-{attempt}", prompt, params, seed=attempt))
        while core.has_unfinished:
            core.step()
        if attempt:
            best = min(best, time.perf_counter() - started)
    return PrefillResult(num_tokens, best, prefill_flops(engine, num_tokens))
