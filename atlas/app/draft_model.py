"""Loading the draft model of `--speculative-config '{"method": "draft_model", ...}'`.

The draft is loaded like a target (the same folder resolution, weight reader and family
loader, so a `--random` bench folder works too) onto the target's backend, in the target's
process. It must share the target's tokenizer: the same number of entries and the same string
at every id, checked before any weight is read. The builder then plans both models' caches
together (`atlas.app.builder`), and wires a second `Worker` over the draft's caches into a
`DraftModelProposer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.app.model_store import ModelNotFoundError, resolve_model
from atlas.app.settings import SettingsError
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.eagle3 import ARCHITECTURES as EAGLE3_ARCHITECTURES
from atlas.domain.models.families import check_supported, fp8_layouts, load_model
from atlas.domain.models.model import Model
from atlas.domain.models.quantization_config import check_quantization
from atlas.domain.models.quantization_weights import checkpoint_bytes
from atlas.ports.gpu import GpuBackend
from atlas.ports.tokenizer import Tokenizer
from atlas.ports.weights import WeightSource

_FIELD = "--speculative-config: speculative_config.model"


@dataclass(frozen=True, slots=True)
class DraftCheckpoint:
    """A checked draft, not loaded yet."""

    spec: str  # as `speculative_config.model` names it
    model_dir: Path
    config: ModelConfig
    weights: WeightSource

    @property
    def weight_bytes(self) -> int:
        return checkpoint_bytes(self.weights)


def open_draft_model(spec: str, target_tokenizer: Tokenizer) -> DraftCheckpoint:
    """Resolve and check the draft named by `spec` before anything is loaded: its folder, config
    and weights. Raises SettingsError naming `speculative_config.model` when it is missing, of
    an unsupported architecture, quantized in a way Atlas cannot read, or has another tokenizer."""
    from atlas.app.builder import open_weights, read_model_config  # the builder imports this module

    try:
        model_dir = resolve_model(spec)
    except ModelNotFoundError as error:
        places = "; ".join(line.strip()[2:] for line in str(error).splitlines() if line.strip().startswith("- "))
        raise SettingsError(f"{_FIELD}: draft {spec!r} not found (looked in: {places}); pass a model folder holding "
                            "config.json, a pulled name or an HF repo id") from None
    try:
        config = read_model_config(model_dir)
        if config.architecture in EAGLE3_ARCHITECTURES:
            raise ValueError(f"{config.architecture} is an EAGLE-3 head, which drafts from the target's hidden "
                             'states; use "method": "eagle3" with it')
        check_supported(config)
        check_quantization(config.raw, fp8_layouts(config), config.architecture)
        tokenizer = HfTokenizer.from_folder(model_dir)
    except ValueError as error:
        raise SettingsError(f"{_FIELD}: draft {spec!r}: {' '.join(str(error).split())}") from None
    mismatch = tokenizer_mismatch(target_tokenizer, tokenizer)
    if mismatch is not None:
        raise SettingsError(f"{_FIELD}: draft {spec!r} does not share the target's tokenizer ({mismatch}); a draft "
                            "model must use the same vocabulary as the target")
    return DraftCheckpoint(spec, model_dir, config, open_weights(model_dir, config))


def load_draft_model(draft: DraftCheckpoint, backend: GpuBackend, max_positions: int) -> Model:
    """Load a checked draft onto `backend`. Raises SettingsError naming `speculative_config.model`
    when it has sliding-window or recurrent layers (its cache is plain full attention)."""
    model = load_model(draft.config, draft.weights, backend, max_positions=max_positions)
    if any(not group.kind.is_kv or group.window is not None for group in model.cache_groups):
        raise SettingsError(f"{_FIELD}: draft {draft.spec!r} ({draft.config.architecture}) has sliding-window or "
                            "recurrent layers; a draft model needs full attention only (a Llama- or Qwen-style model)")
    return model


def tokenizer_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """Why `draft` is not `target`'s tokenizer (a size, or the first id whose string differs),
    or None when they agree at every id."""
    if draft.vocab_size != target.vocab_size:
        return f"vocabulary of {draft.vocab_size} tokens, the target's has {target.vocab_size}"
    for token_id in range(target.vocab_size):
        draft_text, target_text = draft.token_to_text(token_id), target.token_to_text(token_id)
        if draft_text != target_text:
            return f"token {token_id} is {draft_text!r} there and {target_text!r} in the target"
    return None
