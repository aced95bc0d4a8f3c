"""The Python API: `LLM(model).generate(prompts, SamplingParams(...))` and `.chat(messages)`.

It drives the engine core synchronously in the caller's thread (no event loop), with the
same front-end text handling the server uses, and limits numpy's BLAS threads as `atlas serve`
does (`atlas.app.threads`).
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from atlas.app.builder import LoadedEngine, build_engine
from atlas.domain.fan_out import SeedSource, fan_out
from atlas.domain.text.sequence_text import SequenceText, TextDelta
from atlas.app.settings import EngineSettings
from atlas.app.threads import limit_blas_threads
from atlas.domain.batch import SequenceOutput, TokenLogprobs
from atlas.domain.requests import OutputConstraint, Request, SamplingParams
from atlas.ports.tokenizer import Tokenizer

Message = Mapping[str, Any]
PromptInput = str | Sequence[int]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # the engine ended this choice on an error (finish_reason "abort")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (the fewest of its choices)

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class LLM:
    """A model loaded for offline generation. Settings are `EngineSettings` fields;
    `speculative_config` may also be a dict (`{"method": "ngram", "num_speculative_tokens": 4}`)."""

    def __init__(self, model: str, *, show_progress: bool = True, **settings: Any) -> None:
        if isinstance(settings.get("speculative_config"), Mapping):
            settings["speculative_config"] = json.dumps(settings["speculative_config"])
        limit_blas_threads()
        self.engine: LoadedEngine = build_engine(EngineSettings(model=model, **settings), show_progress)
        self._seeds = SeedSource(self.engine.settings.seed, _fresh_seed)

    @classmethod
    def from_settings(cls, settings: EngineSettings, show_progress: bool = True) -> LLM:
        llm = cls.__new__(cls)
        limit_blas_threads()
        llm.engine = build_engine(settings, show_progress)
        llm._seeds = SeedSource(settings.seed, _fresh_seed)
        return llm

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop what the engine runs outside this process (the rank processes of a model on
        several devices, which otherwise live until this process exits) and give its device
        memory back, so another LLM can load in this process. The LLM cannot generate again."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int = 0,
        constraint: OutputConstraint | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids); outputs in prompt order.
        `sampling_params` is one for every prompt or a list with one per prompt (as vLLM's).
        `priority` (lower first) needs `scheduling_policy="priority"`. `constraint` binds every
        choice's tokens (`OutputConstraint(JsonSchema(schema))`: structured output; a
        thinking budget); an invalid grammar raises ParameterError."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = _per_prompt(sampling_params, len(prompts))  # type: ignore[arg-type]
        items = []
        for prompt in prompts:  # type: ignore[union-attr]
            if isinstance(prompt, str):
                items.append((prompt, self.tokenizer.encode(prompt)))
            else:
                items.append((None, [int(t) for t in prompt]))
        return self._run(items, params, priority, constraint)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        priority: int = 0,
        constraint: OutputConstraint | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several, with the chat template;
        `sampling_params` and `constraint` as for `generate`."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        items = []
        for conversation in conversations:
            prompt = self.render_chat(conversation, tools=tools, **(chat_template_kwargs or {}))  # type: ignore[arg-type]
            items.append((prompt, self.tokenizer.encode(prompt, add_special_tokens=False)))
        return self._run(items, _per_prompt(sampling_params, len(items)), priority, constraint)

    def render_chat(self, messages: Sequence[Message], tools=None, **template_kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **template_kwargs)

    def stream_chat(self, messages: Sequence[Message], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the answer's text as it is generated (one choice)."""
        prompt = self.render_chat(messages)
        request = fan_out(_new_id(), self.tokenizer.encode(prompt, add_special_tokens=False),
                          sampling_params or SamplingParams(), self._seeds)[0]
        for _, delta in self._deltas([request]):
            if delta.text:
                yield delta.text

    def _run(
        self, items: list[tuple[str | None, list[int]]], per_prompt: list[SamplingParams], priority: int,
        constraint: OutputConstraint | None = None,
    ) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        choices: dict[str, CompletionOutput] = {}
        owners: dict[str, RequestOutput] = {}
        cached: dict[str, int] = {}
        requests: list[Request] = []
        for (prompt, token_ids), params in zip(items, per_prompt, strict=True):
            request_id = _new_id()
            fanned = fan_out(request_id, token_ids, params, self._seeds, priority=priority)
            if constraint is not None:
                fanned = [msgspec.structs.replace(request, constraint=constraint) for request in fanned]
            outputs = [CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
                       for index in range(len(fanned))]
            results.append(RequestOutput(request_id, prompt, list(token_ids), outputs))
            for request, output in zip(fanned, outputs):
                choices[request.request_id] = output
                owners[request.request_id] = results[-1]
                requests.append(request)
        for engine_output, delta in self._deltas(requests):
            request_id = engine_output.seq_id
            cached[request_id] = engine_output.num_cached_tokens
            choice = choices[request_id]
            choice.text += delta.text
            choice.token_ids.extend(delta.token_ids)
            if choice.logprobs is not None:
                choice.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason.value
                choice.stop_reason = delta.stop_reason
                choice.error = engine_output.error
        for result in results:
            result.num_cached_tokens = min(
                (num for seq_id, num in cached.items() if owners[seq_id] is result), default=0
            )
        return results

    def _deltas(self, requests: list[Request]) -> Iterator[tuple[SequenceOutput, TextDelta]]:
        """Run the engine until every request finishes, yielding text deltas as they come."""
        core, tokenizer = self.engine.core, self.tokenizer
        texts: dict[str, SequenceText] = {}
        try:
            for request in requests:
                core.add_request(request)
                texts[request.request_id] = SequenceText(tokenizer, request.prompt_token_ids, request.sampling)
            while texts:
                for output in core.step():
                    text = texts.get(output.seq_id)
                    if text is None:
                        continue
                    delta = text.apply(output)
                    if delta.stopped_by_text:
                        core.abort(output.seq_id)
                    if delta.finish_reason is not None:
                        del texts[output.seq_id]
                    yield output, delta
        finally:
            for request_id in texts:  # interrupted (an error, or the caller stopped iterating)
                core.abort(request_id)


def _new_id() -> str:
    return uuid.uuid4().hex


def _fresh_seed() -> int:
    return secrets.randbits(64)


def _per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: the one given for all, or a list of exactly `count`."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * count
    per_prompt = list(sampling_params)
    if len(per_prompt) != count or not all(isinstance(p, SamplingParams) for p in per_prompt):
        raise ValueError(f"sampling_params is a list of {len(per_prompt)}: give one SamplingParams, "
                         f"or a list of one per prompt ({count})")
    return per_prompt
