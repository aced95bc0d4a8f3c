"""Test copies of model folders with another chat template (and `<think>` tags as single tokens).

SmolLM2's template knows neither tools nor reasoning. A copy whose tokenizer_config.json holds
a Qwen3-style template, and whose tokenizer has `<think>` and `</think>` as single tokens (two
added tokens SmolLM2 never uses, renamed, so the ids stay inside the model's embedding rows),
serves as a reasoning model on the mock. Weights are linked, not copied.
"""

from __future__ import annotations

import json
from pathlib import Path

THINK_TAGS = ("<think>", "</think>")
SPARE_TOKENS = ("<jupyter_script>", "<empty_output>")  # added tokens SmolLM2's chats never use


def with_chat_template(source: Path, target: Path, template: str, think_tags: bool = False) -> Path:
    """A copy of `source` at `target` rendering with `template`. With `think_tags`, `<think>`
    and `</think>` become single tokens, kept when special tokens are skipped: two spare added
    tokens renamed when the vocabulary has them, else two tokens added (past the model's
    embedding rows: only for tests that run no model)."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name in ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):
            continue
        link = target / path.name
        if not link.exists():
            link.symlink_to(path.resolve())
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    if think_tags:
        _add_think_tags(tokenizer)
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return target


def _add_think_tags(tokenizer: dict) -> None:
    added = tokenizer["added_tokens"]
    spare = [token for token in added if token["content"] in SPARE_TOKENS]
    vocab = tokenizer["model"]["vocab"]
    if len(spare) == 2:
        for token, tag in zip(spare, THINK_TAGS, strict=True):
            vocab[tag] = vocab.pop(token["content"])
            token.update(content=tag, special=False)
        return
    next_id = max(max(vocab.values()), max(token["id"] for token in added)) + 1
    for offset, tag in enumerate(THINK_TAGS):
        added.append({"id": next_id + offset, "content": tag, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": False})

