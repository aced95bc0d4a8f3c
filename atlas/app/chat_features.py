"""The served model's chat features: tool-call and reasoning parsers, reasoning markers, grammar.

`--tool-call-parser` and `--reasoning-parser` take a parser's name, `none` (off) or `auto`
(the default: read from the chat template, `atlas.domain.text`'s detectors). The grammar
compiler validates structured-output and forced-tool-call constraints in the API process; the
engine builds its own (`LazyGrammarCompiler`) to compile them again and fill their token masks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from atlas.domain.reasoning_budget import reasoning_markers
from atlas.domain.request_constraints import GrammarCache
from atlas.domain.text.reasoning import REASONING_PARSERS, detect_reasoning_parser, reasoning_tags
from atlas.domain.text.tool_calls import TOOL_CALL_PARSERS, detect_tool_call_parser
from atlas.ports.grammar import CompiledGrammar, ConstraintSpec, GrammarCompiler, GrammarError, GrammarMatcher

if TYPE_CHECKING:  # the flags' choices are read before anything heavy is imported
    from atlas.adapters.http.engine_client import ChatFeatures
    from atlas.adapters.tokenizers.hf import HfTokenizer

log = logging.getLogger("atlas.server")

AUTO, OFF = "auto", "none"
TOOL_CALL_PARSER_CHOICES = (AUTO, OFF, *TOOL_CALL_PARSERS)
REASONING_PARSER_CHOICES = (AUTO, OFF, *REASONING_PARSERS)


def chat_features(tokenizer: HfTokenizer, model_dir: Path, vocab_size: int, tool_call_parser: str = AUTO,
                  reasoning_parser: str = AUTO) -> ChatFeatures:
    """The features of a loaded model. Raises ValueError naming the flag for an unknown parser."""
    from atlas.adapters.http.engine_client import ChatFeatures

    if tool_call_parser not in TOOL_CALL_PARSER_CHOICES:
        raise ValueError(f"--tool-call-parser: unknown parser {tool_call_parser!r}; "
                         f"choose one of {', '.join(TOOL_CALL_PARSER_CHOICES)}")
    if reasoning_parser not in REASONING_PARSER_CHOICES:
        raise ValueError(f"--reasoning-parser: unknown parser {reasoning_parser!r}; "
                         f"choose one of {', '.join(REASONING_PARSER_CHOICES)}")
    tool_template = tokenizer.chat_template_source(tool_use=True) or ""
    parser = detect_tool_call_parser(tool_template) if tool_call_parser == AUTO else tool_call_parser
    reasoning_name = reasoning_parser
    if reasoning_parser == AUTO:
        reasoning_name = detect_reasoning_parser(tokenizer.chat_template_source() or "") or OFF
    tags = reasoning_tags(reasoning_name) if reasoning_name != OFF else None
    markers = reasoning_markers(tokenizer, tags.start, tags.end) if tags is not None else None
    log.info("chat features: tool-call parser %s, reasoning parser %s",
             parser if parser not in (None, OFF) else "none", tags.name if tags else "none")
    return ChatFeatures(
        tool_call_parser=parser if parser != OFF else None,
        tool_calls_off=parser == OFF,
        reasoning=tags,
        reasoning_markers=markers,
        grammar=grammar_compiler(tokenizer, model_dir, vocab_size),
    )


def grammar_compiler(tokenizer: HfTokenizer, model_dir: Path, vocab_size: int) -> GrammarCompiler | None:
    """llguidance on the model's tokenizer.json, or None (logged) when it cannot be built."""
    from atlas.adapters.grammar.llguidance import LlguidanceCompiler

    try:
        tokenizer_json = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
        return LlguidanceCompiler(tokenizer_json, vocab_size, sorted(tokenizer.eos_token_ids), tokenizer.token_id)
    except (OSError, ValueError, RuntimeError) as error:  # llguidance raises either for a tokenizer it cannot read
        log.warning("structured output is unavailable for this model: %s", error)
        return None


def process_grammars(model_dir: str, vocab_size: int) -> GrammarCache:
    """The grammar cache of a grammar helper process (`atlas.adapters.grammar.process`), built
    there from the model's folder: the compiler now, so the first request does not wait for it."""
    from atlas.adapters.tokenizers.hf import HfTokenizer

    folder = Path(model_dir)
    tokenizer = HfTokenizer.from_folder(folder)
    compiler = grammar_compiler(tokenizer, folder, vocab_size)
    return GrammarCache(compiler if compiler is not None else LazyGrammarCompiler(tokenizer, folder, vocab_size))


class GrammarUnavailable(GrammarError):
    """The model's tokenizer could not be loaded into the grammar engine: no grammar compiles."""


class LazyGrammarCompiler:
    """The engine's `GrammarCompiler` for its model, built on the first compile: llguidance
    reads a tokenizer in a second or more, which an engine that never sees a grammar skips.
    When the tokenizer cannot be read every spec is refused with GrammarUnavailable naming its
    field (the API process refuses them first, with the same reason)."""

    def __init__(self, tokenizer: HfTokenizer, model_dir: Path, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self._built = False

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def compile(self, spec: ConstraintSpec, field: str) -> CompiledGrammar:
        compiler = self._get()
        if compiler is None:
            raise GrammarUnavailable(field, "structured output is unavailable for this model: its tokenizer could "
                                            "not be loaded into the grammar engine")
        return compiler.compile(spec, field)

    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        compiler = self._get()
        if compiler is None:
            raise RuntimeError("fill_bitmasks without a grammar compiler: no matcher can exist")
        compiler.fill_bitmasks(rows, bitmask)

    def _get(self) -> GrammarCompiler | None:
        with self._lock:
            if not self._built:
                self._compiler = grammar_compiler(self._tokenizer, self._model_dir, self._vocab_size)
                self._built = True
            return self._compiler
