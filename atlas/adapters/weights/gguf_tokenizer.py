"""HF tokenizer files from a GGUF vocabulary: tokenizer.json, tokenizer_config.json and
special_tokens_map.json, so `tokenizers`/`transformers` split text exactly as llama.cpp does.

Two vocabulary kinds are handled:
  - "gpt2": byte-level BPE. The merges come from `tokenizer.ggml.merges`; the pre-tokenizer is
    chosen from `tokenizer.ggml.pre`, reproducing llama.cpp's regex split for that name.
  - "llama": SentencePiece. HF's byte-fallback BPE, its merges ranked by the score of the piece
    each merge produces (as transformers converts SentencePiece models).
Control tokens become special added tokens; user-defined tokens plain added tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from atlas.adapters.weights.gguf import GgufImportError

# llama.cpp token types (llama.h `llama_token_type`)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
ADDED_TOKEN_FLAGS = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
METASPACE = "\u2581"  # SentencePiece's visible space

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict[str, Any]:
    """HF's ByteLevel step; with `use_regex` it first splits with the GPT-2 regex."""
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split_then_bytes(regex: str) -> dict[str, Any]:
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _byte_level(False)]}


# `tokenizer.ggml.pre` -> the HF pre-tokenizer splitting text as llama.cpp's regexes for that
# name do (llama-vocab.cpp). smollm/starcoder first split off every digit ("\p{N}") and then
# apply the GPT-2 regex: HF's Digits(individual_digits) followed by a regex-using ByteLevel.
_DIGITS_THEN_GPT2 = {
    "type": "Sequence",
    "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)],
}
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe")
_DIGIT_SPLITTING_NAMES = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais"), _byte_level(True)),
    **dict.fromkeys(_DIGIT_SPLITTING_NAMES, _DIGITS_THEN_GPT2),
    **dict.fromkeys((*_LLAMA3_NAMES, "dbrx", "smaug-bpe"), _split_then_bytes(_LLAMA3_REGEX)),
    **dict.fromkeys(("qwen2", "stablelm2"), _split_then_bytes(_QWEN2_REGEX)),
}


def tokenizer_files(meta: Mapping[str, Any], path: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json contents for the file.

    `meta` is the GGUF metadata, `config` the config.json being written (for the context
    length). Raises GgufImportError for a tokenizer kind or pre-tokenizer it cannot reproduce.
    """
    model_kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(_key(meta, "tokenizer.ggml.tokens", path))
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if model_kind == "gpt2":
        tokenizer = _bpe_tokenizer(meta, path, tokens)
    elif model_kind == "llama":
        tokenizer = _sentencepiece_tokenizer(meta, tokens)
    else:
        raise GgufImportError(
            f"{path}: tokenizer model {model_kind!r} is not supported "
            "(gpt2 byte-level BPE and llama SentencePiece are); use the model's Hugging Face folder instead"
        )
    specials = _special_tokens(meta, tokens)
    tokenizer["added_tokens"] = [
        {"id": idx, "content": tokens[idx], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": kind == CONTROL}
        for idx, kind in enumerate(token_types)
        if kind in (CONTROL, USER_DEFINED)
    ]
    # llama.cpp adds bos by default for SentencePiece vocabularies, never by default for BPE ones.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model_kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tokenizer["post_processor"] = _post_processor(meta, tokens, specials, add_bos, add_eos)
    tokenizer_config: dict[str, Any] = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "added_tokens_decoder": {
            str(added["id"]): {flag: added[flag] for flag in ADDED_TOKEN_FLAGS} for added in tokenizer["added_tokens"]
        },
        **specials,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    templates = _chat_templates(meta)
    if templates is not None:
        tokenizer_config["chat_template"] = templates
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": tokenizer_config, "special_tokens_map.json": specials}


def _key(meta: Mapping[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise GgufImportError(f"{path}: metadata {key!r} is missing; the GGUF file has no usable tokenizer")
    return meta[key]


def _special_tokens(meta: Mapping[str, Any], tokens: list[str]) -> dict[str, str]:
    specials = {}
    for role, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            specials[role] = tokens[token_id]
    return specials


def _tokenizer_json(model: dict[str, Any], normalizer: Any, pre_tokenizer: Any, decoder: Any) -> dict[str, Any]:
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer, "post_processor": None, "decoder": decoder, "model": model}


def _bpe_model(vocab: dict[str, int], merges: list[list[str]], **options: Any) -> dict[str, Any]:
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}
    return {**model, **options, "vocab": vocab, "merges": merges}


def _vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id; a duplicated string keeps its first id (later copies stay reachable by id only)."""
    vocab: dict[str, int] = {}
    for idx, token in enumerate(tokens):
        vocab.setdefault(token, idx)
    return vocab


def _bpe_tokenizer(meta: Mapping[str, Any], path: Path, tokens: list[str]) -> dict[str, Any]:
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise GgufImportError(
            f"{path}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))}); "
            "use the model's Hugging Face folder instead"
        )
    merges = [merge.split(" ", 1) for merge in _key(meta, "tokenizer.ggml.merges", path)]
    # Llama 3 looks whole words up in the vocabulary before merging (llama.cpp and HF agree).
    model = _bpe_model(_vocab(tokens), merges, ignore_merges=pre in _LLAMA3_NAMES)
    normalizer = {"type": "NFC"} if pre == "qwen2" else None  # as HF's Qwen2 tokenizer.json
    return _tokenizer_json(model, normalizer, PRE_TOKENIZERS[pre], _byte_level(True))


def _sentencepiece_tokenizer(meta: Mapping[str, Any], tokens: list[str]) -> dict[str, Any]:
    """SentencePiece as byte-fallback BPE: every split of a piece into two vocabulary pieces is
    a merge, ranked by the merged piece's score (highest first), ties by the parts' ids."""
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = _vocab(tokens)
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = _bpe_model(vocab, [[left, right] for *_, left, right in ranked], fuse_unk=True, byte_fallback=True,
                       unk_token=tokens[unk_id] if unk_id is not None else None)
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    normalizers = [{"type": "Replace", "pattern": {"String": " "}, "content": METASPACE}]
    decoders = [{"type": "Replace", "pattern": {"String": METASPACE}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if add_space_prefix:
        normalizers.insert(0, {"type": "Prepend", "prepend": METASPACE})
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return _tokenizer_json(model, {"type": "Sequence", "normalizers": normalizers}, None,
                           {"type": "Sequence", "decoders": decoders})


def _post_processor(meta: Mapping[str, Any], tokens: list[str], specials: Mapping[str, str],
                    add_bos: bool, add_eos: bool) -> dict[str, Any] | None:
    """Wraps `encode(add_special_tokens=True)` in bos/eos exactly when llama.cpp would add them."""
    wrap = [(role, int(meta[f"tokenizer.ggml.{role}_token_id"]))
            for role, wanted in (("bos", add_bos), ("eos", add_eos)) if wanted and f"{role}_token" in specials]
    if not wrap:
        return _byte_level(True) if meta.get("tokenizer.ggml.model") == "gpt2" else None
    bos = [{"SpecialToken": {"id": tokens[i], "type_id": 0}} for role, i in wrap if role == "bos"]
    eos = [{"SpecialToken": {"id": tokens[i], "type_id": 0}} for role, i in wrap if role == "eos"]
    single = [*bos, {"Sequence": {"id": "A", "type_id": 0}}, *eos]
    pair = [*single, *bos, {"Sequence": {"id": "B", "type_id": 1}}, *eos]
    special_tokens = {tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]} for _, i in wrap}
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens}


def _chat_templates(meta: Mapping[str, Any]) -> str | list[dict[str, str]] | None:
    """The default template, or HF's list form when the file also carries named ones."""
    default = meta.get("tokenizer.chat_template")
    named = {key.removeprefix("tokenizer.chat_template."): value for key, value in meta.items()
             if key.startswith("tokenizer.chat_template.")}
    if not named:
        return default
    templates = [{"name": "default", "template": default}] if default is not None else []
    return templates + [{"name": name, "template": template} for name, template in sorted(named.items())]
