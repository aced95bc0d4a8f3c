"""The HF tokenizer adapter and the tokenizers the GGUF importer builds.

Byte-level BPE output is compared with an independent plain-Python implementation of
llama.cpp's algorithm (tests/helpers/checkpoints.py); chat templates with hand-written
expectations; the real SmolLM2 tokenizer with transformers when it is installed.
"""

from __future__ import annotations

import json
import shutil
import types
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from helpers.checkpoints import reference_bpe_encode, smollm2_folder, tiny_llama_gguf

from atlas.adapters.tokenizers.hf import HfTokenizer, TokenizerFileError
from atlas.adapters.weights.gguf_import import import_gguf, tokenizer_files
from atlas.ports.tokenizer import ChatTemplateError

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SAMPLES = [
    "hello world",
    "Hello, world! 12 hello",
    "  hello\n\nworld\t ",
    "héllo wörld 🤖 中文",
    "don't stop 2024-01-01",
    "<|im_start|>user\nhello world<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    tiny_llama_gguf(root / "tiny.gguf", np.random.default_rng(7))
    return import_gguf(root / "tiny.gguf", root / "model", progress=False)


def _vocab_and_merges(folder: Path) -> tuple[dict[str, int], list[str]]:
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    return model["vocab"], [" ".join(pair) for pair in model["merges"]]


def _folder_with(tmp_path: Path, source: Path, tokenizer_config: dict | None = None, **files: object) -> Path:
    """A copy of `source`'s tokenizer.json plus the given config files (dicts as JSON, str as text)."""
    folder = tmp_path / "model"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"} if tokenizer_config is None else tokenizer_config
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        filename = name.replace("__", ".")
        (folder / filename).write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


# ----------------------------------------------------------------------------- imported byte-level BPE


@pytest.mark.parametrize("text", SAMPLES)
def test_imported_bpe_matches_the_reference_algorithm(tiny_folder: Path, text: str) -> None:
    vocab, merges = _vocab_and_merges(tiny_folder)
    tokenizer = HfTokenizer.from_folder(tiny_folder)
    assert tokenizer.encode(text) == reference_bpe_encode(text, vocab, merges, special_tokens=SPECIALS)


def test_merges_apply_and_digits_are_split_one_by_one(tiny_folder: Path) -> None:
    tokenizer = HfTokenizer.from_folder(tiny_folder)
    vocab, _ = _vocab_and_merges(tiny_folder)
    assert tokenizer.encode("hello world") == [vocab["hello"], vocab["Ġworld"]]
    assert tokenizer.encode("12") == [vocab["1"], vocab["2"]]  # the "1 2" merge exists but smollm splits digits
    assert tokenizer.token_to_text(vocab["Ġworld"]) == "Ġworld"
    assert tokenizer.token_id("<|im_end|>") == 2


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_inverts_encode(tiny_folder: Path, text: str) -> None:
    tokenizer = HfTokenizer.from_folder(tiny_folder)
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_and_skippable(tiny_folder: Path) -> None:
    tokenizer = HfTokenizer.from_folder(tiny_folder)
    ids = tokenizer.encode("<|im_start|>hello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 3
    assert tokenizer.decode(ids) == "hello"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    assert tokenizer.eos_token_ids == frozenset({2}) and tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == len(_vocab_and_merges(tiny_folder)[0])


def test_imported_chat_template_renders(tiny_folder: Path) -> None:
    tokenizer = HfTokenizer.from_folder(tiny_folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- imported SentencePiece


def test_sentencepiece_vocab_becomes_byte_fallback_bpe(tmp_path: Path) -> None:
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "hell",
        "hello",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "▁world",
        "ld",
    ]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    token_types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    scores[tokens.index("▁hello")] = 5.0
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    for name, content in tokenizer_files(meta, tmp_path / "x.gguf", {"max_position_embeddings": 64}).items():
        (tmp_path / name).write_text(json.dumps(content))
    tokenizer = HfTokenizer.from_folder(tmp_path)
    ids = tokenizer.encode("hello world")
    assert ids == [1, tokens.index("▁hello"), tokens.index("▁world")]  # bos added: add_bos_token defaults on for llama
    assert tokenizer.encode("hello", add_special_tokens=False) == [tokens.index("▁hello")]
    e_acute = tokenizer.encode("é", add_special_tokens=False)
    assert e_acute == [tokens.index("▁"), tokens.index("<0xC3>"), tokens.index("<0xA9>")]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.decode(tokenizer.encode("hello é world")) == "hello é world"


# ----------------------------------------------------------------------------- chat templates


def test_tojson_keeps_unicode_and_markup_and_accepts_options(tmp_path: Path, tiny_folder: Path) -> None:
    template = "{{ messages[0]['content'] | tojson }}|{{ {'b': 1, 'a': [2]} | tojson(indent=1, sort_keys=True) }}"
    tokenizer = HfTokenizer.from_folder(_folder_with(tmp_path, tiny_folder, chat_template__jinja=template))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": 'Café <b> "q"'}])
    assert rendered == '"Café <b> \\"q\\""|{\n "a": [\n  2\n ],\n "b": 1\n}'


def test_raise_exception_becomes_a_chat_template_error_with_its_message(tmp_path: Path, tiny_folder: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must start with user') }}"
        "{% endif %}ok"
    )
    tokenizer = HfTokenizer.from_folder(_folder_with(tmp_path, tiny_folder, chat_template__jinja=template))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation roles must start with user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_variables_helpers_and_extensions(tmp_path: Path, tiny_folder: Path) -> None:
    template = (
        "{{ bos_token }}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m.role }}:{{ m.content }}]{% endgeneration %}{% endfor %}"
        "{% if tools %}tools={{ tools | map(attribute='name') | join(',') }}{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
        "|{{ strftime_now('%Y') }}{% if add_generation_prompt %}|gen{% endif %}{{ eos_token }}"
    )
    tokenizer = HfTokenizer.from_folder(_folder_with(tmp_path, tiny_folder, chat_template__jinja=template))
    messages = [
        {"role": "system", "content": "s"},
        types.MappingProxyType({"role": "user", "content": "u"}),
        {"role": "assistant", "content": "never"},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tools=[{"name": "search"}, {"name": "calc"}], enable_thinking=False
    )
    year = str(datetime.now().year)
    assert rendered == f"<|im_start|>[system:s][user:u]tools=search,calc/no_think|{year}|gen<|im_end|>"
    plain = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False)
    assert plain == f"<|im_start|>[system:s]|{year}<|im_end|>"


def test_blocks_are_trimmed_like_transformers(tmp_path: Path, tiny_folder: Path) -> None:
    template = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}\n"
    tokenizer = HfTokenizer.from_folder(_folder_with(tmp_path, tiny_folder, chat_template__jinja=template))
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        == "    a\n    b\n"
    )


def test_template_sources_in_order_of_precedence(tmp_path: Path, tiny_folder: Path) -> None:
    config = {"eos_token": "<|im_end|>", "chat_template": "from-config"}
    folder = _folder_with(tmp_path, tiny_folder, config)
    assert HfTokenizer.from_folder(folder).apply_chat_template([]) == "from-config"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "from-json"}))
    assert HfTokenizer.from_folder(folder).apply_chat_template([]) == "from-json"
    (folder / "chat_template.jinja").write_text("from-jinja")
    assert HfTokenizer.from_folder(folder).apply_chat_template([]) == "from-jinja"


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path: Path, tiny_folder: Path) -> None:
    config = {
        "chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "with {{ tools | length }} tools"},
        ]
    }
    tokenizer = HfTokenizer.from_folder(_folder_with(tmp_path, tiny_folder, config))
    assert tokenizer.apply_chat_template([]) == "plain"
    assert tokenizer.apply_chat_template([], tools=[{"name": "a"}]) == "with 1 tools"


def test_missing_and_broken_templates_are_chat_template_errors(tmp_path: Path, tiny_folder: Path) -> None:
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        HfTokenizer.from_folder(_folder_with(tmp_path, tiny_folder, {})).apply_chat_template(
            [{"role": "user", "content": "x"}]
        )
    broken = _folder_with(tmp_path / "b", tiny_folder, chat_template__jinja="{% for m in messages %}no end")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        HfTokenizer.from_folder(broken).apply_chat_template([])
    typed = _folder_with(tmp_path / "c", tiny_folder, chat_template__jinja="{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateError, match="failed on these messages: TypeError"):
        HfTokenizer.from_folder(typed).apply_chat_template([{"role": "user", "content": "x"}])


def test_templates_run_in_an_immutable_sandbox(tmp_path: Path, tiny_folder: Path) -> None:
    folder = _folder_with(tmp_path, tiny_folder, chat_template__jinja="{{ messages.append({'role': 'x'}) }}")
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="unsafe"):
        HfTokenizer.from_folder(folder).apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "x"}]
    escape = _folder_with(
        tmp_path / "e", tiny_folder, chat_template__jinja="{{ ''.__class__.__mro__[1].__subclasses__() }}"
    )
    with pytest.raises(ChatTemplateError):
        HfTokenizer.from_folder(escape).apply_chat_template(messages)


# ----------------------------------------------------------------------------- special ids and files


def test_eos_ids_merge_tokenizer_generation_and_model_configs(tmp_path: Path, tiny_folder: Path) -> None:
    config = {"bos_token": {"content": "<|im_start|>", "__type": "AddedToken"}, "eos_token": {"content": "<|im_end|>"}}
    folder = _folder_with(
        tmp_path,
        tiny_folder,
        config,
        generation_config__json={"eos_token_id": [0, 2]},
        config__json={"eos_token_id": 7, "bos_token_id": 1},
    )
    tokenizer = HfTokenizer.from_folder(folder)
    assert tokenizer.eos_token_ids == frozenset({0, 2, 7})
    assert tokenizer.bos_token_id == 1


def test_special_tokens_map_fills_in_what_tokenizer_config_lacks(tmp_path: Path, tiny_folder: Path) -> None:
    folder = _folder_with(
        tmp_path,
        tiny_folder,
        {},
        special_tokens_map__json={"eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"},
        chat_template__jinja="{{ bos_token }}|{{ eos_token }}",
    )
    tokenizer = HfTokenizer.from_folder(folder)
    assert tokenizer.eos_token_ids == frozenset({0}) and tokenizer.bos_token_id == 1
    assert tokenizer.apply_chat_template([]) == "<|im_start|>|<|endoftext|>"


def test_missing_or_corrupt_tokenizer_file_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFileError, match="has no tokenizer.json.*import-gguf"):
        HfTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    with pytest.raises(TokenizerFileError, match="cannot be loaded.*re-download or re-import"):
        HfTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(TokenizerFileError):
        HfTokenizer.from_folder(tmp_path)


# ----------------------------------------------------------------------------- the real SmolLM2 tokenizer

SMOLLM2_SAMPLES = [
    "What is the capital of France?",
    "The year 1999 had 365 days; π≈3.14159!",
    "def f(x):\n    return x**2  # square\n\n\n",
    "Ünïcödé, emoji 🤖🚀, 中文字符, العربية",
    "it's we'll they've I'd   multiple   spaces\t\ttabs",
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    folder = smollm2_folder()
    if folder is None:
        pytest.skip("no SmolLM2: run `atlas pull smollm2` or set ATLAS_SMOLLM2_GGUF")
    return folder


@pytest.mark.parametrize("text", SMOLLM2_SAMPLES)
def test_smollm2_tokenization_matches_the_reference_algorithm(smollm2: Path, text: str) -> None:
    vocab, merges = _vocab_and_merges(smollm2)
    assert HfTokenizer.from_folder(smollm2).encode(text) == reference_bpe_encode(text, vocab, merges)


def test_smollm2_special_ids_and_chat_template(smollm2: Path) -> None:
    tokenizer = HfTokenizer.from_folder(smollm2)
    assert tokenizer.eos_token_ids == frozenset({2}) and tokenizer.bos_token_id == 1 and tokenizer.vocab_size == 49152
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(prompt)
    assert ids[:3] == [1, 9690, 198] and ids[-3:] == [1, 520, 9531, 198][-3:]


@pytest.mark.oracle
def test_smollm2_agrees_with_transformers(smollm2: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(smollm2)
    ours = HfTokenizer.from_folder(smollm2)
    for text in SMOLLM2_SAMPLES:
        assert ours.encode(text) == reference.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France?"},
    ]
    for add_generation_prompt in (True, False):
        assert ours.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt
        ) == reference.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)


def test_encode_batch_gives_each_text_what_encode_gives(tiny_folder: Path) -> None:
    tokenizer = HfTokenizer.from_folder(tiny_folder)
    texts = ["hello world", "", "12345 and more", "<|im_start|>user"]
    for add_special_tokens in (True, False):
        assert tokenizer.encode_batch(texts, add_special_tokens) == [
            tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts
        ]
