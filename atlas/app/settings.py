"""Engine settings: the one place their defaults live (CLI flags and ATLAS_* variables map here)."""

from __future__ import annotations

from dataclasses import dataclass

from atlas.domain.requests import ParameterError
from atlas.domain.scheduling_policy import POLICIES
from atlas.domain.speculative.config import SpeculativeConfig, SpeculativeMethod

DEVICES = ("auto", "cuda", "mock")
DTYPES = ("auto", "bf16", "f32")
KV_CACHE_DTYPES = ("auto", "bf16", "f16", "f32", "fp8", "fp8_e4m3")  # fp8 = fp8_e4m3
QUANTIZATIONS = ("none", "fp8")
SCHEDULING_POLICIES = tuple(POLICIES)
GRAMMAR_PROCESS = ("auto", "on", "off")
MAX_RANKS = 8  # the GPUs of one host


class SettingsError(ValueError):
    """A setting out of range; the message names the flag and the fix."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    model: str
    device: str = "auto"
    dtype: str = "auto"  # activations: auto = f32 on the mock (the reference), bf16 on GPUs
    max_seq_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 128  # sequences running at once
    max_batch_size: int | None = None  # largest decode batch captured as a graph (default: max_num_seqs)
    max_prefill_tokens: int = 2048  # token budget of one step; longer prompts are chunked
    # prompt tokens the requests a step admits may hold (None: a sixteenth of max_prefill_tokens)
    max_admitted_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.90
    kv_cache_gb: float | None = None  # fixed KV size instead of the utilisation rule (mock default: 2)
    kv_cache_dtype: str = "auto"
    quantization: str = "none"  # fp8: quantize a float checkpoint's projections per output channel at load
    scheduling_policy: str = "fifo"  # or "priority": lower Request.priority first
    prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (--no-prefix-caching)
    enforce_eager: bool = False  # never capture graphs
    # a token row's bits independent of its step's other rows (CUDA, up to 8 rows a step): greedy
    # output with a speculative proposer is then the output without one
    batch_invariant: bool = False
    seed: int | None = None  # seeds requests that bring none (None: a fresh random seed each)
    tensor_parallel_size: int = 1  # ranks (devices) the model splits over, one process each
    enable_expert_parallel: bool = False  # MoE: place whole experts on ranks instead of splitting each
    speculative_config: str | None = None  # --speculative-config JSON (SpeculativeConfig); None: off
    # the grammar state (matchers, accepts, mask fills) in a helper process; auto: off for now
    grammar_process: str = "auto"

    @property
    def admitted_tokens(self) -> int:
        """The cap on the prompt tokens of the requests one step admits."""
        if self.max_admitted_tokens is not None:
            return self.max_admitted_tokens
        return max(self.max_prefill_tokens // 16, 1)

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the experts are placed over: every rank with --enable-expert-parallel."""
        return self.tensor_parallel_size if self.enable_expert_parallel else 1

    @property
    def is_parallel(self) -> bool:
        """Whether the model runs on rank processes, one per device."""
        return self.tensor_parallel_size > 1

    def __post_init__(self) -> None:
        _choice("--device", self.device, DEVICES)
        _choice("--dtype", self.dtype, DTYPES)
        _choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("--quantization", self.quantization, QUANTIZATIONS)
        _choice("--scheduling-policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("--grammar-process", self.grammar_process, GRAMMAR_PROCESS)
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise SettingsError(f"--max-seq-len must be at least 2 (got {self.max_seq_len})")
        if self.max_num_seqs < 1:
            raise SettingsError(f"--max-num-seqs must be at least 1 (got {self.max_num_seqs})")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise SettingsError(f"--max-batch-size must be at least 1 (got {self.max_batch_size})")
        if self.max_prefill_tokens < 16:
            raise SettingsError(f"--max-prefill-tokens must be at least 16 (got {self.max_prefill_tokens})")
        if self.max_admitted_tokens is not None and self.max_admitted_tokens < 1:
            raise SettingsError(f"--max-admitted-tokens must be at least 1 (got {self.max_admitted_tokens})")
        if self.block_size not in (8, 16, 32, 64):
            raise SettingsError(f"--block-size must be 8, 16, 32 or 64 (got {self.block_size})")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise SettingsError(
                f"--gpu-memory-utilization must be between 0.05 and 0.99 (got {self.gpu_memory_utilization})"
            )
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise SettingsError(f"--kv-cache-gb must be positive (got {self.kv_cache_gb})")
        if not 1 <= self.tensor_parallel_size <= MAX_RANKS:
            raise SettingsError(
                f"--tensor-parallel-size must be between 1 and {MAX_RANKS} (got {self.tensor_parallel_size})"
            )
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise SettingsError(
                "--enable-expert-parallel places the experts over the --tensor-parallel-size ranks; "
                "give --tensor-parallel-size 2 or more"
            )
        speculative = _parse_speculative(self.speculative_config)
        if speculative is not None and speculative.method is not SpeculativeMethod.NGRAM and self.is_parallel:
            raise SettingsError(
                f"--speculative-config: speculative_config.method: {speculative.method.value} runs on one device; "
                "drop --tensor-parallel-size or use ngram"
            )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed `--speculative-config` (None: no speculation)."""
        return _parse_speculative(self.speculative_config)


def _parse_speculative(text: str | None) -> SpeculativeConfig | None:
    """Raises SettingsError naming the flag and the key for a configuration that is invalid."""
    if text is None:
        return None
    try:
        return SpeculativeConfig.from_json(text)
    except ParameterError as error:
        raise SettingsError(f"--speculative-config: {error}") from None


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SettingsError(f"{flag} must be one of {', '.join(choices)} (got {value!r})")
