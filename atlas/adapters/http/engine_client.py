"""What the HTTP layer needs from the engine and the model, as the app layer provides it.

The engine runs in this process (`EngineActor`) or in its own (`EngineProcessClient`); both
satisfy `EngineClient`. An `EngineLauncher` loads the model and runs the engine for as long as
its context is open; the app's lifespan enters it in the background so `/health` can answer
503 while the model loads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from atlas.domain.engine_events import EngineHealth, StreamItem
from atlas.domain.engine import EngineStats
from atlas.domain.requests import ReasoningMarkers, Request
from atlas.domain.text.reasoning import ReasoningTags
from atlas.ports.grammar import GrammarCompiler
from atlas.ports.tokenizer import Tokenizer


class OutputStream(Protocol):
    """One request's outputs in order (`atlas.app.engine_actor.OutputStream`)."""

    def take(self) -> list[StreamItem]:
        """Every queued item, oldest first; [] when none is."""
        ...

    @property
    def at_end(self) -> bool:
        """Nothing is queued and nothing more will be."""
        ...

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Until an item is queued or the stream is at its end (at once when either holds
        already) or `wake()` is called: True; or until `timeout_s` passed: False."""
        ...

    def wake(self) -> None:
        """End a `wait` now."""
        ...

    async def receive(self) -> StreamItem:
        """The next item, waiting for it; anyio.EndOfStream once the stream has ended."""
        ...

    def receive_nowait(self) -> StreamItem:
        """The next item if one is queued; anyio.WouldBlock if not, anyio.EndOfStream at the end."""
        ...

    def close(self) -> None:
        """Stop reading (the engine is told separately, by `EngineClient.abort`)."""
        ...

    def __aiter__(self) -> AsyncIterator[StreamItem]: ...


class EngineClient(Protocol):
    def submit(self, requests: Sequence[Request]) -> OutputStream:
        """Run one front-end request's sequences; their outputs (or one EngineFailure) arrive
        on the stream, which closes when every sequence has finished or been aborted."""
        ...

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop sequences now; their KV blocks are freed before the engine's next step."""
        ...

    def stats(self) -> EngineStats: ...

    def health(self) -> EngineHealth: ...


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Values for sampling fields a request leaves out: the model's generation_config.json,
    then --override-generation-config, then greedy decoding (as `atlas generate` and `atlas chat`
    do), so a bare request gets the model's most likely answer."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True, slots=True)
class ChatFeatures:
    """What the served model's template and tokenizer allow beyond plain text, fixed at load
    (`--tool-call-parser`, `--reasoning-parser`, or detected from the chat template).

    `tool_call_parser` reads calls in `tool_choice` auto; None when the template shows no known
    markup or `tool_calls_off` (`--tool-call-parser none`: tools are rendered, the output is
    content). `forced_tool_markup` is the markup a grammar forces a call into: the parser's, else
    hermes' (a template that ignores tools has none of its own). `grammar` validates constraints
    in the API process (the engine compiles them again and applies their token masks).
    """

    tool_call_parser: str | None = None
    tool_calls_off: bool = False
    reasoning: ReasoningTags | None = None
    reasoning_markers: ReasoningMarkers | None = None  # single-token tags: a thinking budget can be kept
    grammar: GrammarCompiler | None = None

    @property
    def forced_tool_markup(self) -> str | None:
        if self.tool_calls_off:
            return None
        return self.tool_call_parser or "hermes"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model as clients see it."""

    name: str  # the id in /v1/models and the `model` field
    aliases: frozenset[str]  # other names accepted in the `model` field (the spec it was loaded from)
    tokenizer: Tokenizer
    max_model_len: int  # prompt + output tokens
    vocab_size: int  # ids the model accepts (its embedding rows)
    seed: int | None  # --seed: the base of seeds for requests that bring none
    created_s: int  # when it was loaded, for /v1/models
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    chat: ChatFeatures = ChatFeatures()

    def accepts(self, requested: str | None) -> bool:
        return requested is None or requested == self.name or requested in self.aliases


EngineLauncher = Callable[[], AbstractAsyncContextManager[tuple[ServedModel, EngineClient]]]
