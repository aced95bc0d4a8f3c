"""Lark grammars (llguidance's dialect) for forced tool calls in each parser's markup.

`tool_choice` "required" or a named function makes the model write calls, so the output is
constrained to the markup the model was trained on, the one its tool-call parser reads:

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (\\n-separated)
    llama3_json   {"name": "f", "parameters": {...}}                              (; -separated)
    mistral       [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]           (v3 tokenizers)
                  [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}                (with an [ARGS] token)
    qwen3_coder   <tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>

JSON parts are `%json` sub-grammars of the tool's parameter schema, written in json.dumps'
compact style (", " and ": "), key order as the schema lists them (name before arguments, so
the parser streams the arguments). A qwen3_coder value follows its parameter's type: strings
are raw text up to the closing tag (within minLength/maxLength, or matching `pattern`),
numbers and booleans their JSON forms, enums one of their strings, other types JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from atlas.ports.grammar import ForcedToolCalls, FunctionTool

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# How a special token is written in the grammar: `<[id]>` when the vocabulary has it as one
# token, else its text as a literal.
SpecialToken = Callable[[str], str]

_INTEGER = r"/-?(0|[1-9][0-9]*)/"
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"


def tool_call_lark(spec: ForcedToolCalls, special_token: SpecialToken, has_args_token: bool) -> str:
    """The grammar of `spec`; raises ValueError for an unknown markup or no tools."""
    if not spec.tools:
        raise ValueError("no tools to call")
    builders = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral, "qwen3_coder": _qwen3_coder}
    if spec.markup not in builders:
        raise ValueError(f"no forced tool-call grammar for markup {spec.markup!r}; use one of {', '.join(builders)}")
    rules = builders[spec.markup](spec, special_token, has_args_token)
    return "\n".join(["%llguidance {}", *rules]) + "\n"


def _start(spec: ForcedToolCalls, separator: str | None, may_trail: bool = False) -> str:
    """`start: call`, or one or more calls (joined by `separator`) when parallel calls are
    allowed. `may_trail`: the separator (a newline) may also end the output, so a model that
    writes the newline it learnt after a call is not locked into writing another one."""
    if not spec.parallel:
        return "start: call"
    if not separator:
        return "start: call+"
    return f"start: call ({separator} call)*" + (f" {separator}?" if may_trail else "")


def _parameters(tool: FunctionTool) -> dict[str, Any]:
    """The arguments schema; a tool without one takes no arguments (`{}`), as OpenAI reads it."""
    if tool.parameters:
        return dict(tool.parameters)
    return {"type": "object", "properties": {}, "additionalProperties": False}


def _json_rule(name: str, schema: Mapping[str, Any]) -> str:
    return f"{name}: %json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}"


def _call_object(tool: FunctionTool, arguments_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments_key: _parameters(tool)},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _alternatives(name: str, num_tools: int) -> str:
    return f"{name}: " + " | ".join(f"{name}_{idx}" for idx in range(num_tools))


def _hermes(spec: ForcedToolCalls, special_token: SpecialToken, has_args_token: bool) -> list[str]:
    rules = [
        _start(spec, '"\\n"', may_trail=True),
        'call: "<tool_call>\\n" call_object "\\n</tool_call>"',
        _alternatives("call_object", len(spec.tools)),
        *(_json_rule(f"call_object_{idx}", _call_object(tool, "arguments")) for idx, tool in enumerate(spec.tools)),
    ]
    return rules


def _llama3_json(spec: ForcedToolCalls, special_token: SpecialToken, has_args_token: bool) -> list[str]:
    return [
        _start(spec, '"; "'),
        _alternatives("call", len(spec.tools)),
        *(_json_rule(f"call_{idx}", _call_object(tool, "parameters")) for idx, tool in enumerate(spec.tools)),
    ]


def _mistral(spec: ForcedToolCalls, special_token: SpecialToken, has_args_token: bool) -> list[str]:
    tool_calls = special_token("[TOOL_CALLS]")
    if has_args_token:
        args = special_token("[ARGS]")
        return [
            _start(spec, None),
            f"call: {tool_calls} named_call",
            _alternatives("named_call", len(spec.tools)),
            *(f"named_call_{idx}: {json.dumps(tool.name)} {args} arguments_{idx}" for idx, tool in enumerate(spec.tools)),
            *(_json_rule(f"arguments_{idx}", _parameters(tool)) for idx, tool in enumerate(spec.tools)),
        ]
    items = ' (", " call_object)*' if spec.parallel else ""
    return [
        f'start: {tool_calls} " [" call_object{items} "]"',
        _alternatives("call_object", len(spec.tools)),
        *(_json_rule(f"call_object_{idx}", _call_object(tool, "arguments")) for idx, tool in enumerate(spec.tools)),
    ]


def _qwen3_coder(spec: ForcedToolCalls, special_token: SpecialToken, has_args_token: bool) -> list[str]:
    rules = [_start(spec, '"\\n"', may_trail=True), _alternatives("call", len(spec.tools))]
    for idx, tool in enumerate(spec.tools):
        schema = _parameters(tool)
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        parts = []
        for key_idx, (key, parameter) in enumerate(properties.items()):
            rule = f"parameter_{idx}_{key_idx}"
            head = json.dumps(f"<parameter={key}>\n")
            rules.extend(_qwen3_coder_value(rule, head, parameter if isinstance(parameter, Mapping) else {}))
            parts.append(rule if key in required else f"{rule}?")
        open_tag = json.dumps(f"<tool_call>\n<function={tool.name}>\n")
        rules.append(f'call_{idx}: {open_tag} {" ".join(parts)} "</function>\\n</tool_call>"')
    return rules


def _string_value(parameter: Mapping[str, Any]) -> str:
    """The regex of a raw string value: its `pattern` (anchors dropped), else any text within
    minLength..maxLength characters. `format` is not enforced."""
    pattern = parameter.get("pattern")
    if isinstance(pattern, str):
        return "(" + pattern.removeprefix("^").removesuffix("$").replace("/", "\\/") + ")"
    low = int(parameter.get("minLength", 0))
    high = parameter.get("maxLength")
    return f"(?s:.{{{low},{int(high)}}})" if high is not None else f"(?s:.{{{low},}})"


def _qwen3_coder_value(rule: str, head: str, parameter: Mapping[str, Any]) -> list[str]:
    """Rules for one `<parameter=k>\\nvalue\\n</parameter>\\n`, the value by the parameter's type."""
    close = '"\\n</parameter>\\n"'
    kind = parameter.get("type")
    if "enum" in parameter and all(isinstance(item, str) for item in parameter["enum"]):
        options = " | ".join(json.dumps(item) for item in parameter["enum"])
        return [f"{rule}: {head} ({options}) {close}"]
    if kind == "string" or not kind:
        # Lazy: the value ends at the first closing tag, which it cannot contain.
        return [f"{rule}: {head} {rule}_text", f"{rule}_text[lazy]: /{_string_value(parameter)}\\n<\\/parameter>\\n/"]
    if kind == "integer":
        return [f"{rule}: {head} {_INTEGER} {close}"]
    if kind == "number":
        return [f"{rule}: {head} {_NUMBER} {close}"]
    if kind == "boolean":
        return [f'{rule}: {head} ("true" | "false") {close}']
    return [f"{rule}: {head} {rule}_json {close}", _json_rule(f"{rule}_json", parameter)]
