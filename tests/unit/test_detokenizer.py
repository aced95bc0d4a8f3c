"""Incremental detokenizing with real tokenizers built here by the `tokenizers` library.

A byte-level BPE (GPT-2 / SmolLM2 style) trained on text with multi-byte characters splits
characters across tokens, and even glues the end of one character to the start of the next;
a SentencePiece-style tokenizer (Metaspace + byte fallback, Llama 2 style) drops the leading
space of the first token it decodes. The real SmolLM2 tokenizer is used when it is on disk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from atlas.domain.text import IncrementalDetokenizer
from atlas.ports.tokenizer import ChatTemplateError

REPLACEMENT = "\ufffd"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, café déjà vu. 日本語のテキスト 日本 東京 🎉🚀 emoji 👍🏽 naïve façade",
    "The quick brown fox jumps over the lazy dog. ¿Qué tal? Ünïcödé 中文 한국어 Ωμέγα",
]
SAMPLE_TEXTS = [
    "日本 🎉 café",
    "Ünïcödé façade: 東京へ行きましょう! 👍🏽👍🏽 done.",
    " leading space, then 中文 and 한국어 🚀",
    "plain ascii only",
]


class TokenizerAdapter:
    """The `Tokenizer` port over a `tokenizers.Tokenizer`; records each decode's length."""

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self._tokenizer = tokenizer
        self.decode_lengths: list[int] = []

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self._tokenizer.token_to_id("<|im_end|>")
        return frozenset() if eos is None else frozenset({eos})

    @property
    def bos_token_id(self) -> int | None:
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(token_ids))
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_text(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(token_id)

    def token_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        assert token_id is not None, f"{token!r} is not in the vocabulary"
        return token_id

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        raise ChatTemplateError("no chat template in this test tokenizer")

    @property
    def renders_tools(self) -> bool:
        return False


def byte_level_bpe() -> TokenizerAdapter:
    tokenizer = HfTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 50, trainer)
    return TokenizerAdapter(tokenizer)


def sentencepiece_style() -> TokenizerAdapter:
    """Metaspace words, and raw UTF-8 bytes as <0xNN> tokens for characters it never saw."""
    tokenizer = HfTokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(["Hello world, the quick brown fox jumps over the lazy dog again"] * 50, trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    first_byte_id = len(vocab)
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = first_byte_id + byte
    return TokenizerAdapter(HfTokenizer.from_str(json.dumps(spec)))


def smollm2() -> TokenizerAdapter:
    directory = os.environ.get("ATLAS_SMOLLM2_DIR")
    folder = Path(directory) if directory else Path.home() / ".cache/atlas/models/smollm2"
    path = folder / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"SmolLM2 tokenizer not found at {path} (set ATLAS_SMOLLM2_DIR)")
    return TokenizerAdapter(HfTokenizer.from_file(str(path)))


@pytest.fixture(scope="module")
def bpe() -> TokenizerAdapter:
    return byte_level_bpe()


@pytest.fixture(scope="module", params=["byte-level BPE", "SmolLM2"])
def byte_level(request: pytest.FixtureRequest, bpe: TokenizerAdapter) -> TokenizerAdapter:
    return bpe if request.param == "byte-level BPE" else smollm2()


def stream(
    tokenizer: TokenizerAdapter,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    chunk_sizes: Sequence[int] | None = None,
    skip_special_tokens: bool = True,
) -> list[str]:
    """Every chunk the detokenizer emits, the flush last."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    chunks, start = [], 0
    for size in chunk_sizes or [1] * len(output_ids):
        chunks.append(detokenizer.push(output_ids[start : start + size]))
        start += size
    assert start == len(output_ids)
    chunks.append(detokenizer.flush())
    return chunks


def expected_text(tokenizer: TokenizerAdapter, prompt_ids: list[int], output_ids: list[int], skip: bool = True) -> str:
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip)
    full_text = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text) :]


# -- byte-level BPE ------------------------------------------------------------------------


def test_the_tokenizer_really_splits_characters(bpe: TokenizerAdapter) -> None:
    ids = bpe.encode("日本 🎉 café")
    assert any(REPLACEMENT in bpe.decode([token_id]) for token_id in ids)
    assert bpe.decode(ids) == "日本 🎉 café"


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_streamed_text_never_holds_half_a_character(byte_level: TokenizerAdapter, text: str) -> None:
    prompt_ids = byte_level.encode("Question: translate this. Answer:")
    output_ids = byte_level.encode(text)
    chunks = stream(byte_level, prompt_ids, output_ids)
    assert "".join(chunks) == text
    assert not any(REPLACEMENT in chunk for chunk in chunks)
    assert chunks[-1] == ""  # everything came out before the flush
    if len(text) > 20:
        assert sum(1 for chunk in chunks if chunk) > 5  # it streams, it does not just buffer


@pytest.mark.parametrize("seed", range(5))
def test_pushing_several_tokens_at_once_gives_the_same_text(bpe: TokenizerAdapter, seed: int) -> None:
    rng = np.random.default_rng(seed)
    prompt_ids = bpe.encode("Say something:")
    output_ids = bpe.encode(" ".join(SAMPLE_TEXTS))
    sizes: list[int] = []
    while sum(sizes) < len(output_ids):
        sizes.append(min(int(rng.integers(1, 5)), len(output_ids) - sum(sizes)))
    chunks = stream(bpe, prompt_ids, output_ids, sizes)
    assert "".join(chunks) == " ".join(SAMPLE_TEXTS)
    assert not any(REPLACEMENT in chunk for chunk in chunks)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(30))
def test_random_ids_stream_exactly_what_decode_gives(
    byte_level: TokenizerAdapter, seed: int, skip_special_tokens: bool
) -> None:
    rng = np.random.default_rng(seed)
    prompt_ids = byte_level.encode("日本語 prompt 🎉")
    output_ids = rng.integers(0, byte_level.vocab_size, 60).tolist()
    special_ids = [byte_level.token_id(token) for token in SPECIAL_TOKENS]
    for idx in rng.choice(60, 4, replace=False):  # some special tokens among the pieces
        output_ids[idx] = special_ids[int(idx) % len(special_ids)]
    chunks = stream(byte_level, prompt_ids, output_ids, skip_special_tokens=skip_special_tokens)
    full = expected_text(byte_level, prompt_ids, output_ids, skip_special_tokens)
    assert "".join(chunks) == full
    emitted = ""
    for chunk in chunks:
        emitted += chunk
        assert full.startswith(emitted)  # nothing emitted is ever taken back
        assert REPLACEMENT not in chunk or REPLACEMENT in full


def test_special_tokens_are_skipped_or_shown(bpe: TokenizerAdapter) -> None:
    output_ids = bpe.encode("Hi 日本") + bpe.encode("<|im_end|>") + bpe.encode(" there")
    assert "".join(stream(bpe, bpe.encode("Q:"), output_ids)) == "Hi 日本 there"
    shown = "".join(stream(bpe, bpe.encode("Q:"), output_ids, skip_special_tokens=False))
    assert shown == "Hi 日本<|im_end|> there"


def byte_token_id(tokenizer: TokenizerAdapter, byte: int) -> int:
    """The byte-level BPE token of one raw byte (GPT-2's printable byte alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    shifted = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + shifted.index(byte))
    return tokenizer.token_id(char)


def test_an_unfinished_character_is_released_at_flush(bpe: TokenizerAdapter) -> None:
    lead_byte = byte_token_id(bpe, 0xE6)  # first byte of a 3-byte character
    detokenizer = IncrementalDetokenizer(bpe, bpe.encode("Q:"))
    assert detokenizer.push(bpe.encode(" ok")) == " ok"
    assert detokenizer.push([lead_byte]) == ""
    assert detokenizer.push([byte_token_id(bpe, 0x97)]) == ""
    assert detokenizer.flush() == REPLACEMENT
    assert detokenizer.flush() == ""


def test_a_character_completed_by_its_last_byte_comes_out_whole(bpe: TokenizerAdapter) -> None:
    detokenizer = IncrementalDetokenizer(bpe, bpe.encode("Q:"))
    pieces = [detokenizer.push([byte_token_id(bpe, byte)]) for byte in "日".encode()]
    assert pieces == ["", "", "日"]


def test_junk_bytes_keep_the_window_bounded(bpe: TokenizerAdapter) -> None:
    # Lead bytes that never get their continuation: the text stays U+FFFD forever, and the
    # detokenizer must not keep decoding an ever longer window.
    output_ids = [byte_token_id(bpe, 0xF0)] * 400 + bpe.encode(" fine 日本")
    bpe.decode_lengths.clear()
    chunks = stream(bpe, bpe.encode("Q:"), output_ids)
    assert max(bpe.decode_lengths) <= 40
    assert "".join(chunks) == expected_text(bpe, bpe.encode("Q:"), output_ids)
    assert "".join(chunks).endswith(" fine 日本")


def test_cost_per_token_does_not_grow_with_length(bpe: TokenizerAdapter) -> None:
    output_ids = bpe.encode(" ".join(SAMPLE_TEXTS * 60))
    assert len(output_ids) > 2000
    bpe.decode_lengths.clear()
    chunks = stream(bpe, bpe.encode("Q:" * 50), output_ids)
    assert "".join(chunks) == " ".join(SAMPLE_TEXTS * 60)
    assert max(bpe.decode_lengths) <= 12
    # one decode per token, plus one each time the window slides (every ~5 tokens)
    assert len(bpe.decode_lengths) <= len(output_ids) * 5 // 4 + 2


# -- SentencePiece style (Metaspace, byte fallback) ----------------------------------------


@pytest.fixture(scope="module")
def metaspace() -> TokenizerAdapter:
    return sentencepiece_style()


def test_the_first_output_word_keeps_its_leading_space(metaspace: TokenizerAdapter) -> None:
    prompt_ids = metaspace.encode("Hello")
    output_ids = metaspace.encode("world again")
    assert metaspace.decode(output_ids) == "world again"  # decoded alone, the space is gone
    chunks = stream(metaspace, prompt_ids, output_ids)
    assert "".join(chunks) == " world again"
    assert chunks[0] == " " + metaspace.decode(output_ids[:1])
    # Without a prompt there is nothing to separate from: decode's own text.
    assert "".join(stream(metaspace, [], output_ids)) == "world again"


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_byte_fallback_characters_come_out_whole(metaspace: TokenizerAdapter, text: str) -> None:
    prompt_ids = metaspace.encode("the quick")
    output_ids = metaspace.encode(text)
    chunks = stream(metaspace, prompt_ids, output_ids)
    assert "".join(chunks) == expected_text(metaspace, prompt_ids, output_ids)
    assert not any(REPLACEMENT in chunk for chunk in chunks)
