"""Fixtures shared by unit test modules: SmolLM2's real tokenizer and an llguidance compiler
for it (the test skips when SmolLM2 is not pulled)."""

from __future__ import annotations

import pytest
from helpers.checkpoints import smollm2_folder

from atlas.adapters.grammar.llguidance import LlguidanceCompiler
from atlas.adapters.tokenizers.hf import HfTokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> HfTokenizer:
    folder = smollm2_folder()
    if folder is None:
        pytest.skip("SmolLM2 is not pulled (atlas pull smollm2)")
    return HfTokenizer.from_folder(folder)


@pytest.fixture(scope="session")
def smollm2_compiler(smollm2_tokenizer: HfTokenizer) -> LlguidanceCompiler:
    folder = smollm2_folder()
    assert folder is not None
    return LlguidanceCompiler((folder / "tokenizer.json").read_text(), smollm2_tokenizer.vocab_size,
                              smollm2_tokenizer.eos_token_ids, smollm2_tokenizer.token_id)
