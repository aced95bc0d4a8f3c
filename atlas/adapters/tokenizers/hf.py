"""The Hugging Face tokenizer adapter: `tokenizers` for text <-> ids, Jinja2 for chat templates.

Reads a model folder the way `transformers` does: tokenizer.json for the tokenizer itself,
tokenizer_config.json (and special_tokens_map.json) for the special tokens, the chat template
from chat_template.jinja, chat_template.json or tokenizer_config.json (first found wins), and
the end-of-sequence ids from tokenizer_config.json, generation_config.json and config.json.
Templates run in Jinja's immutable sandbox with the helpers HF templates expect.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from atlas.ports.tokenizer import ChatTemplateError

_PROBE_TOOL_NAME = "atlas_probe_tool_7f3c"
SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerFileError(ValueError):
    """The model folder has no usable tokenizer files; the message names the file and the fix."""


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` (assistant-mask markers) as a plain block."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's tojson: plain json.dumps without HTML escaping, keeping non-ASCII text as is."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message as HF templates read it: tool call arguments given as a JSON string (the
    OpenAI wire form) become the dict they encode; anything else passes unchanged."""
    result = dict(message)
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        result["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
    return result


def _template_tool_call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            function["arguments"] = decoded
    return {**call, "function": function}


def make_template_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox HF renders chat templates in: trimmed blocks, loop controls, HF helpers."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerFileError(f"{path} is not valid JSON ({exc}); re-download or re-import the model") from None
    return content if isinstance(content, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_templates(folder: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """name -> template source, from the newest layout present ("default" for an unnamed one)."""
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        templates = {"default": jinja_path.read_text(encoding="utf-8")}
        extra_dir = folder / "additional_chat_templates"
        if extra_dir.is_dir():
            templates.update({p.stem: p.read_text(encoding="utf-8") for p in sorted(extra_dir.glob("*.jinja"))})
        return templates
    source = _read_json(folder / "chat_template.json").get("chat_template") or tokenizer_config.get("chat_template")
    if isinstance(source, str):
        return {"default": source}
    if isinstance(source, list):
        named = (item for item in source if isinstance(item, Mapping) and "template" in item)
        return {str(item.get("name", "default")): str(item["template"]) for item in named}
    return {}


class HfTokenizer:
    """A model folder's tokenizer, special tokens and chat templates (the `Tokenizer` port)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
        extra_eos_token_ids: Sequence[int] = (),
        fallback_bos_token_id: int | None = None,
        name: str = "tokenizer",
    ) -> None:
        self._tokenizer = tokenizer
        self.special_tokens = dict(special_tokens)
        self.chat_templates = dict(chat_templates)
        self.name = name
        self._template_cache: dict[str, jinja2.Template] = {}
        eos_ids = set(extra_eos_token_ids)
        if "eos_token" in self.special_tokens:
            eos_id = tokenizer.token_to_id(self.special_tokens["eos_token"])
            if eos_id is not None:
                eos_ids.add(eos_id)
        self._eos_token_ids = frozenset(eos_ids)
        bos = self.special_tokens.get("bos_token")
        bos_id = tokenizer.token_to_id(bos) if bos is not None else None
        self._bos_token_id = bos_id if bos_id is not None else fallback_bos_token_id

    @classmethod
    def from_folder(cls, folder: Path | str) -> HfTokenizer:
        """Load the tokenizer of a Hugging Face model folder.

        Raises TokenizerFileError when tokenizer.json is missing or unreadable, naming the fix.
        A missing chat template is not an error here: `apply_chat_template` reports it.
        """
        folder = Path(folder)
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise TokenizerFileError(
                f"{folder} has no tokenizer.json; Atlas needs the fast-tokenizer file "
                "(re-download the model with it, or import a GGUF file with `atlas import-gguf`)"
            )
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust side raises a bare Exception for any parse failure
            raise TokenizerFileError(
                f"{tokenizer_path} cannot be loaded ({exc}); re-download or re-import the model"
            ) from None
        tokenizer_config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        special_tokens = {}
        for role in SPECIAL_TOKEN_ROLES:
            text = _token_text(tokenizer_config.get(role)) or _token_text(special_map.get(role))
            if text is not None:
                special_tokens[role] = text
        generation_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")
        nested = model_config.get("text_config")  # multimodal configs keep the language model's ids here
        text_config: dict[str, Any] = nested if isinstance(nested, dict) else {}
        eos_ids = [*_ids(generation_config.get("eos_token_id")), *_ids(model_config.get("eos_token_id")),
                   *_ids(text_config.get("eos_token_id"))]
        bos_ids = _ids(model_config.get("bos_token_id")) or _ids(generation_config.get("bos_token_id"))
        return cls(tokenizer, special_tokens, _chat_templates(folder, tokenizer_config), eos_ids,
                   bos_ids[0] if bos_ids else None, name=str(folder))

    @cached_property
    def vocab_size(self) -> int:
        """Vocabulary entries plus added tokens."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """eos of tokenizer_config.json plus every eos id in generation_config.json and config.json."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        """The bos token's id (tokenizer_config.json, else config.json), or None."""
        return self._bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the tokenizer's own bos/eos wrapping
        applies (pass False for a rendered chat prompt whose template already wrote them)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, in order, on the tokenizers library's threads (GIL released).
        Through `encode_batch_fast` where the library has it (0.21 on): the same ids without the
        character offsets, which nothing here reads; 2,080-word texts 1.2-2.3x faster."""
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [encoding.ids for encoding in encode(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; an incomplete UTF-8 tail comes out as U+FFFD."""
        ids = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)  # no copy on the hot path
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_text(self, token_id: int) -> str:
        """The raw vocabulary string ("Ġthe" for byte-level BPE); "" for ids past the vocabulary."""
        return self._tokenizer.id_to_token(token_id) or ""

    def token_id(self, text: str) -> int | None:
        """The id of a whole vocabulary entry or added token, or None."""
        return self._tokenizer.token_to_id(text)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the model's template (the "tool_use" one when tools are given
        and the model has it). Assistant `tool_calls` reach the template with their `arguments`
        as a dict (templates write `arguments | tojson` or iterate its items), as Hugging Face
        chat templates expect; `role: tool` messages pass as they are. Raises ChatTemplateError
        when there is no template, and with the template's own message when it rejects the
        conversation."""
        template = self._template(tool_use=bool(tools))
        variables = {
            **self.special_tokens,
            **template_kwargs,
            "messages": [template_message(message) for message in messages],
            "tools": [dict(tool) for tool in tools] if tools else None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the request: {exc.message or exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template writes the tool definitions into the prompt.

        Found by rendering one user message with a probe tool: a template that ignores `tools`
        (SmolLM2's) leaves the probe's name out. False when there is no template or it fails.
        """
        probe = {"type": "function", "function": {"name": _PROBE_TOOL_NAME, "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}
        try:
            prompt = self.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe])
        except ChatTemplateError:
            return False
        return _PROBE_TOOL_NAME in prompt

    def chat_template_source(self, tool_use: bool = False) -> str | None:
        """The source of the template `apply_chat_template` renders with (the "tool_use" one
        when `tool_use` and the model has it), or None when the model has no template; the
        server reads the tool-call and reasoning markup it writes from it."""
        name = self._template_name(tool_use)
        return self.chat_templates[name] if name is not None else None

    def _template_name(self, tool_use: bool) -> str | None:
        if not self.chat_templates:
            return None
        if tool_use and "tool_use" in self.chat_templates:
            return "tool_use"
        if "default" in self.chat_templates:
            return "default"
        return next(iter(self.chat_templates))

    def _template(self, tool_use: bool) -> jinja2.Template:
        name = self._template_name(tool_use)
        if name is None:
            raise ChatTemplateError(
                f"{self.name} has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja); "
                "use the completions endpoint with a plain prompt, or add a template to the model folder"
            )
        if name not in self._template_cache:
            try:
                self._template_cache[name] = make_template_environment().from_string(self.chat_templates[name])
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(
                    f"the chat template of {self.name} does not parse: {exc.message} (line {exc.lineno})"
                ) from None
        return self._template_cache[name]
