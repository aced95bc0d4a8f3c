"""`atlas doctor MODEL`: which layer of a port goes wrong, measured against transformers.

One prompt runs through Atlas as one prefill step on the chosen device, its residual stream
read after every layer (`Model.forward`'s observer). Where transformers is installed, the same
tokens run through transformers on the CPU twice: in float32 on the weights as Atlas holds them
(rounded to bf16), the reference, and in bf16, whose distance to the reference is the noise a
bf16 port cannot avoid. Each layer's relative error ||atlas - reference|| / ||reference|| (over
every token of the prompt) is held to a bound:

    Atlas computing in bf16 (GPUs)     max(3 x transformers' own bf16 error at that layer, 1e-3)
    Atlas computing in float32 (mock)  1e-3: both sides compute in float32 on the same weights,
                                       so only summation order differs (~1e-6); a wrong norm,
                                       rotation, routing or cache read is 1e-2 and up

The first layer past its bound (or with a non-finite hidden state) is named, and `atlas doctor`
exits 1. The reference runs the config Atlas reads: where an older transformers ignores a value
of config.json (GPT-OSS's swiglu_alpha and swiglu_limit before 5.19), its modules are given the
value and a line says so; else a checkpoint whose value is not the published one would be blamed
on Atlas at its first layer. Without transformers (or for an architecture it does not know)
Atlas runs alone and only non-finite hidden states are caught. `--reference FOLDER` compares
against another checkpoint of the same model (the original of a GGUF import, say).

torch and transformers are imported only here, inside the functions that need them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.adapters.weights.safetensors import SafetensorsWeights
from atlas.app.backends import make_backend
from atlas.app.builder import read_model_config
from atlas.app.model_store import resolve_model
from atlas.app.progress import Progress
from atlas.domain.batch import BlockTable, SamplingRow, ScheduledBatch, ScheduledSequence
from atlas.domain.device_caches import allocate_caches
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.families import check_supported, load_model
from atlas.domain.models.feed_forward import DenseFeedForward, MoeFeedForward
from atlas.domain.models.layers import Layer
from atlas.domain.models.mixers import AttentionMixer, DeltaNetMixer
from atlas.domain.models.model import Model
from atlas.domain.worker import Worker, WorkerConfig
from atlas.ports.gpu import DType, Tensor

DEFAULT_PROMPT = (
    "The capital of France is Paris. The capital of Italy is Rome. A server answers requests from many "
    "clients at the same time, and each client reads its answer as a stream of small pieces."
)
F32_BOUND = 1e-3
BF16_NOISE_FACTOR = 3.0
BF16_FLOOR = 1e-3
_BLOCK_SIZE = 16
_GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)

Write = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LayerCheck:
    """One layer: Atlas's hidden state after it against the reference's."""

    index: int
    kind: str  # "gated deltanet + moe", ...
    rms: float  # of Atlas's hidden state: not finite means it broke, reference or not
    error: float | None = None  # relative to transformers float32; None without a reference
    noise: float | None = None  # transformers bf16 against float32, same layer
    bound: float | None = None

    @property
    def ok(self) -> bool:
        return math.isfinite(self.rms) and (self.error is None or self.error <= self.bound)


@dataclass(frozen=True, slots=True)
class DoctorReport:
    model: str
    architecture: str
    device: str
    activation_dtype: DType
    num_tokens: int
    layers: tuple[LayerCheck, ...]
    reference: str | None  # what Atlas was compared with; None: it ran alone
    logits_error: float | None = None  # of the last token's logits
    logits_bound: float | None = None

    @property
    def first_bad_layer(self) -> int | None:
        return next((check.index for check in self.layers if not check.ok), None)

    @property
    def passed(self) -> bool:
        logits_ok = self.logits_error is None or self.logits_error <= self.logits_bound
        return self.first_bad_layer is None and logits_ok


def layer_bound(noise: float, activation_dtype: DType) -> float:
    """The error a layer may show: see the module docstring."""
    if activation_dtype is DType.F32:
        return F32_BOUND
    return max(BF16_NOISE_FACTOR * noise, BF16_FLOOR)


def run_doctor(
    model: str,
    device: str = "auto",
    dtype: str = "auto",
    prompt: str = DEFAULT_PROMPT,
    reference: str | None = None,
    write: Write = print,
    show_progress: bool = True,
) -> DoctorReport:
    """Compare Atlas with transformers layer by layer on `prompt` and print the table through
    `write` (see the module docstring; weight-loading progress goes to stderr). Raises
    ValueError for what the user can fix: an unknown model or architecture, an empty prompt, a
    device that is not there."""
    model_dir = resolve_model(model)
    config = read_model_config(model_dir)
    check_supported(config)
    token_ids = HfTokenizer.from_folder(model_dir).encode(prompt)
    if not token_ids:
        raise ValueError("--prompt: the prompt encodes to no tokens; give some text")
    backend = make_backend(device, config.model_type, dtype)
    dtype_name = backend.capabilities.activation_dtype.value
    write(f"atlas doctor: {model_dir} ({config.architecture}), {len(token_ids)} prompt tokens, {backend.name} {dtype_name}")
    write(f"running Atlas on {backend.capabilities.device_name} ...")
    progress = Progress(f"loading {config.architecture} weights", enabled=show_progress)
    loaded = load_model(config, SafetensorsWeights(model_dir), backend, max_positions=len(token_ids),
                        progress=progress.update)
    hidden, logits = _atlas_states(loaded, token_ids)
    reference_dir = resolve_model(reference) if reference is not None else model_dir
    states = _transformers_states(reference_dir, token_ids, config, len(loaded.layers), write)
    if states is None:
        checks = tuple(LayerCheck(index, _kind(layer), _rms(hidden[index])) for index, layer in enumerate(loaded.layers))
        report = DoctorReport(str(model_dir), config.architecture, backend.name, backend.capabilities.activation_dtype,
                              len(token_ids), checks, None)
    else:
        report = _compare(str(model_dir), config.architecture, loaded, backend.name, hidden, logits, *states)
    _print(report, write)
    return report


def _atlas_states(model: Model, token_ids: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """Atlas's hidden state after each layer [N, H] and the last token's logits [V], from one
    step over caches just large enough for the prompt."""
    backend, num_tokens = model.backend, len(token_ids)
    num_blocks = -(-num_tokens // _BLOCK_SIZE)
    pages = tuple(num_blocks if group.kind.is_kv else 1 for group in model.cache_groups)
    kv_dtype = backend.capabilities.activation_dtype
    caches = allocate_caches(backend, model.cache_groups, pages, _BLOCK_SIZE, kv_dtype)
    worker = Worker(backend, model, caches, WorkerConfig(num_tokens, 1, num_tokens))
    blocks = tuple(range(num_blocks))
    num_kv = sum(1 for group in model.cache_groups if group.kind.is_kv)
    sequence = ScheduledSequence(
        "doctor", tuple(token_ids), 0, blocks, _GREEDY,
        kv_block_tables=(BlockTable(blocks),) * num_kv, state_slots=(0,) * (len(model.cache_groups) - num_kv),
    )  # fmt: skip
    hidden: list[np.ndarray] = []

    def observe(index: int, residual: Tensor) -> None:
        hidden.append(np.asarray(backend.begin_download(residual).wait(), np.float32).copy())

    logits = worker.compute_logits(ScheduledBatch(0, (sequence,), _BLOCK_SIZE), observe)
    return hidden, np.asarray(logits[0], np.float32)


def _transformers_states(folder: Path, token_ids: list[int], config: ModelConfig, num_layers: int, write: Write):
    """(float32 hidden states, float32 logits, bf16 hidden states, bf16 logits, a description)
    from transformers on the CPU, or None (said why) where it is missing or cannot load the
    model. Where the installed transformers ignores a config value Atlas reads (GPT-OSS's
    clamped SwiGLU before 5.19), its model is given Atlas's value and a line says so: the
    reference computes the checkpoint's model, not the one transformers hard-codes."""
    try:
        import torch
        import transformers
    except ImportError:
        write("transformers is not installed (pip install -e '.[oracle]'): Atlas runs alone, and only "
              "non-finite hidden states are caught")
        return None
    write(f"loading transformers {transformers.__version__} (float32 on Atlas's bf16 weights) from {folder} ...")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as error:
        architecture = json.loads((folder / "config.json").read_text()).get("architectures", ["?"])[0]
        write(f"transformers {transformers.__version__} cannot load {architecture} ({error}); Atlas runs alone")
        return None
    model.eval()
    with torch.no_grad():
        for parameter in model.parameters():  # the values Atlas's bf16 weights hold
            parameter.copy_(parameter.to(torch.bfloat16).to(torch.float32))
    held = match_gpt_oss_experts(model, config.swiglu_alpha, config.swiglu_limit)
    if held is not None:
        write(f"transformers {transformers.__version__} builds GPT-OSS's experts with swiglu_alpha {held[0]:g} and "
              f"swiglu_limit {held[1]:g} whatever config.json says (5.19 on read it): they get config.json's "
              f"{config.swiglu_alpha:g} and {config.swiglu_limit:g}")
    layers = _decoder_layers(model, num_layers)
    exact = _run_transformers(model, layers, token_ids)
    write("running transformers in bf16 (its own rounding error, the noise floor) ...")
    noisy = _run_transformers(model.to(torch.bfloat16), layers, token_ids)
    return (*exact, *noisy, f"transformers {transformers.__version__} float32")


def match_gpt_oss_experts(model, alpha: float, limit: float) -> tuple[float, float] | None:
    """Give the experts of a transformers GPT-OSS `model` the clamped SwiGLU's `alpha` and
    `limit` (config.json's `swiglu_alpha`, `swiglu_limit`), which transformers before 5.19 does not
    read: it builds them with the published checkpoints' 1.702 and 7.0. Returns the (alpha, limit)
    they held where that differed, else None; a model of another family is left as it is."""
    if model.config.model_type != "gpt_oss":
        return None
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    held = None
    for module in model.modules():
        if isinstance(module, GptOssExperts) and (module.alpha, module.limit) != (alpha, limit):
            held = (module.alpha, module.limit)
            module.alpha, module.limit = alpha, limit
    return held


def _decoder_layers(model, num_layers: int):
    """transformers' list of decoder layers: the module list as long as the model's layers."""
    import torch

    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"cannot find the {num_layers} decoder layers in transformers' {type(model).__name__}")


def _run_transformers(model, layers, token_ids: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    import torch

    hidden: list[np.ndarray] = []

    def keep(module, arguments, output) -> None:
        state = output[0] if isinstance(output, tuple) else output
        hidden.append(state[0].float().numpy().copy())

    hooks = [layer.register_forward_hook(keep) for layer in layers]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids])).logits[0, -1].float().numpy()
    finally:
        for hook in hooks:
            hook.remove()
    return hidden, logits


def _compare(model_dir, architecture, model: Model, device, hidden, logits, exact, exact_logits, noisy,
             noisy_logits, reference) -> DoctorReport:
    dtype = model.backend.capabilities.activation_dtype
    checks = []
    for index, layer in enumerate(model.layers):
        noise = _relative(noisy[index], exact[index])
        checks.append(LayerCheck(index, _kind(layer), _rms(hidden[index]), _relative(hidden[index], exact[index]), noise,
                                 layer_bound(noise, dtype)))
    logits_noise = _relative(noisy_logits, exact_logits)
    return DoctorReport(model_dir, architecture, device, dtype, hidden[0].shape[0], tuple(checks), reference,
                        _relative(logits, exact_logits), layer_bound(logits_noise, dtype))


def _print(report: DoctorReport, write: Write) -> None:
    compared = report.reference is not None
    header = f"{'layer':>5}  {'kind':<28} {'rms':>9}"
    write(header + (f" {'error':>9} {'bf16 noise':>10} {'bound':>9}" if compared else ""))
    for check in report.layers:
        line = f"{check.index:>5}  {check.kind:<28} {check.rms:>9.3g}"
        if compared:
            line += f" {check.error:>9.2e} {check.noise:>10.2e} {check.bound:>9.2e}"
        write(line + ("" if check.ok else "  <-- FAIL"))
    if report.logits_error is not None:
        write(f"{'':>5}  {'logits (last token)':<28} {'':>9} {report.logits_error:>9.2e} {'':>10} {report.logits_bound:>9.2e}")
    bad = report.first_bad_layer
    against = f"against {report.reference}" if compared else "without a reference"
    if bad is not None:
        check = report.layers[bad]
        why = "its hidden state is not finite" if not math.isfinite(check.rms) else (
            f"error {check.error:.2e} > bound {check.bound:.2e}")
        write(f"FAIL: layer {bad} ({check.kind}) is the first to leave the noise {against}: {why}")
    elif not report.passed:
        write(f"FAIL: the logits leave the noise {against}: error {report.logits_error:.2e} > bound {report.logits_bound:.2e}")
    else:
        write(f"ok: all {len(report.layers)} layers within their bounds {against}")


def _kind(layer: Layer) -> str:
    mixer, feed_forward = layer.mixer, layer.feed_forward
    if isinstance(mixer, AttentionMixer):
        spec = mixer.spec
        mixing = ("gated " if spec.gated_output else "") + ("sliding " if spec.sliding_window else "") + "attention"
    elif isinstance(mixer, DeltaNetMixer):
        mixing = "gated deltanet"
    else:
        mixing = type(mixer).__name__
    if isinstance(feed_forward, MoeFeedForward):
        mlp = "moe"
    elif isinstance(feed_forward, DenseFeedForward):
        mlp = "dense"
    else:
        mlp = type(feed_forward).__name__
    return f"{mixing} + {mlp}"


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def _relative(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(ours - reference) / max(np.linalg.norm(reference), 1e-30))
