"""Tool calling: ``tools``, ``tool_choice``, ``parallel_tool_calls``, and tool calls in the history.

How the model sees the tools: through the chat template's own tool format when the template
uses ``tools`` (HF semantics: ``apply_chat_template(messages, tools=[...])``); otherwise through
kvmesh's fallback, the Hermes format: a system prompt that lists the functions' JSON signatures
in ``<tools></tools>`` and asks for each call as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``; an assistant message's tool calls are rendered that way in its content,
and a ``tool`` message as a user turn in ``<tool_response></tool_response>``.

What it may answer, by ``tool_choice``:
- ``none``: text, never parsed for calls (the tools are still shown, as OpenAI does);
- ``auto`` (the default with tools): text, in which ``<tool_call>`` blocks whose JSON names a
  tool are the answer's tool calls (``finish_reason: "tool_calls"``), the rest its content
  (without trailing whitespace, streamed or not). Arguments the model wrote as JSON text are
  decoded once. A tool with ``strict: true`` is not grammar-enforced in ``auto`` (the model may
  answer text): a call to it whose arguments do not validate against its ``parameters`` is not
  a call, its block stays in the content;
- ``required``: grammar-constrained to a JSON list of ``{"name", "arguments"}`` objects, each
  naming a tool with arguments matching its ``parameters`` (one, with
  ``parallel_tool_calls: false``), so the calls always parse;
- a named function: grammar-constrained to that function's arguments (its ``parameters``).

With ``required`` or a named function, ``stop`` and ``stop_token_ids`` are refused (400 naming
them): they would cut the arguments mid-JSON. An answer cut by ``max_tokens`` whose arguments
do not parse is content, with ``finish_reason: "length"``, never a tool call.

Streaming: with ``auto`` the content streams up to where a ``<tool_call>`` may begin, and the
rest is parsed when the answer ends; with ``required`` or a named function all of it is, then
sent as each call's id and name, then its arguments (``delta.tool_calls``), or as content when
``max_tokens`` cut it short: a call's fragments sent as they came could not be taken back once
the answer turned out not to parse, and a client would have a call it cannot run.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from kvmesh.engine.structured import MAX_GRAMMAR_CHARS, GrammarError, GuidedDecoding, check_guided

__all__ = [
    "MESSAGE_TOOL_CALLS_SCHEMA",
    "TOOLS_SCHEMA",
    "TOOL_CHOICE_SCHEMA",
    "Tool",
    "ToolCall",
    "ToolSet",
    "hermes_system_prompt",
    "parse_message_tool_calls",
    "parse_tool_choice",
    "parse_tools",
    "template_has_tools",
]

MAX_TOOLS = 128  # OpenAI's limit
# All of a request's tool schemas together, in characters of compact JSON: each is compiled at the
# router (on its event loop) and, for ``required``, all of them make one grammar, which may not
# exceed MAX_GRAMMAR_CHARS either.
MAX_TOOLS_SCHEMA_CHARS = MAX_GRAMMAR_CHARS
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_OPEN_TAG = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
ToolChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool = False  # with tool_choice auto: a call whose arguments do not validate is text

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parameters_grammar(parameters: dict[str, Any], where: str) -> None:
    try:
        check_guided(GuidedDecoding.json_schema(parameters))
    except GrammarError as exc:
        raise ValueError(f"{where} is not a JSON schema kvmesh can enforce: {exc}") from exc


def parse_tools(value: Any) -> tuple[Tool, ...] | None:
    """OpenAI's ``tools``: function tools, each with a unique name and a parameters schema."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return value
    if not isinstance(value, list):
        raise ValueError("tools must be a list of function tools")
    if len(value) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools are allowed, got {len(value)}")
    # The schemas' total size first: a request with many large schemas is refused before any is compiled.
    total = 0
    for item in value:
        if isinstance(item, dict) and isinstance(item.get("function"), dict):
            total += len(json.dumps(item["function"].get("parameters"), separators=(",", ":"), default=str))
        if total > MAX_TOOLS_SCHEMA_CHARS:
            raise ValueError(f"the tools' parameters schemas may have at most {MAX_TOOLS_SCHEMA_CHARS} characters together")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type") != "function":
            raise ValueError(f"tools[{i}]: only tools of type 'function' are supported")
        extra = sorted(set(item) - {"type", "function"})
        if extra:
            raise ValueError(f"unsupported parameter in tools[{i}]: {extra[0]}")
        function = item.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"tools[{i}].function must be an object with a name")
        extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if extra:
            raise ValueError(f"unsupported parameter in tools[{i}].function: {extra[0]}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
        if any(t.name == name for t in tools):
            raise ValueError(f"tools[{i}]: the function name {name!r} is used twice")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        if function.get("strict") not in (None, True, False):
            raise ValueError(f"tools[{i}].function.strict must be a boolean")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        _parameters_grammar(parameters, f"tools[{i}].function.parameters")
        tools.append(Tool(name, description, parameters, function.get("strict") is True))
    return tuple(tools)


def parse_tool_choice(value: Any) -> str | None:
    """``none`` / ``auto`` / ``required``, or a function's name for ``{"type": "function",
    "function": {"name": ...}}`` (returned as ``function:<name>``)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, str) and value.startswith("function:"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "function"}:
        function = value["function"]
        if isinstance(function, dict) and set(function) == {"name"} and isinstance(function["name"], str):
            return f"function:{function['name']}"
    raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


@dataclass(slots=True)
class ToolSet:
    """A request's tools and what it may answer with them."""

    tools: tuple[Tool, ...]
    mode: ToolChoiceMode
    named: Tool | None = None
    parallel: bool = True
    call_ids: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, tools: tuple[Tool, ...] | None, choice: str | None, parallel: bool | None) -> ToolSet | None:
        """None when the request has no tools (``tool_choice`` other than ``none`` then is a
        ValueError, as OpenAI refuses it)."""
        if not tools:
            if choice not in (None, "none"):
                raise ValueError("tool_choice is only allowed when tools are given")
            return None
        if choice is None:
            choice = "auto"
        if choice.startswith("function:"):
            name = choice.removeprefix("function:")
            named = next((t for t in tools if t.name == name), None)
            if named is None:
                raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
            return cls(tools, "named", named, parallel is not False)
        return cls(tools, choice, None, parallel is not False)  # type: ignore[arg-type]

    # -- the grammar -------------------------------------------------------------------
    def guided(self) -> GuidedDecoding | None:
        """The grammar that makes the answer parse: for ``required`` and a named function."""
        if self.mode == "named":
            assert self.named is not None
            return GuidedDecoding.json_schema(self.named.parameters)
        if self.mode != "required":
            return None
        # Each tool's schema lives at $defs/tool_<i> (its own $defs hoisted beside it, renamed),
        # its $refs rewritten to point there: a schema's "#/$defs/X" means its own definitions.
        defs: dict[str, Any] = {}
        for i, t in enumerate(self.tools):
            defs.update(_embedded(t.parameters, f"tool_{i}"))
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/tool_{i}"}},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for i, t in enumerate(self.tools)
            ]
        }
        schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        schema["$defs"] = defs
        return GuidedDecoding.json_schema(schema)

    # -- the answer --------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content and tool calls."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            assert self.named is not None
            try:
                json.loads(text)
            except json.JSONDecodeError:  # cut short (max_tokens): text, not a call that does not parse
                return text, []
            # the arguments as generated: the same string a stream sends in fragments
            return None, [ToolCall(self._call_id(0), self.named.name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens
                return text, []
            return None, [
                ToolCall(self._call_id(i), c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                for i, c in enumerate(calls)
            ]
        by_name = {t.name: t for t in self.tools}
        found: list[ToolCall] = []
        spans: list[tuple[int, int]] = []  # the blocks that are calls (with parallel_tool_calls false, past the first too)
        for match in _TOOL_CALL.finditer(text):
            try:
                call = json.loads(match.group(1))
            except json.JSONDecodeError:
                continue
            if not isinstance(call, dict) or call.get("name") not in by_name:
                continue
            arguments = call.get("arguments", call.get("parameters", {}))
            if isinstance(arguments, str):  # the model wrote them as JSON text: not encoded twice
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    pass
            tool = by_name[call["name"]]
            if tool.strict and not _validates(arguments, tool.parameters):
                continue  # strict: arguments that do not match the schema are no call (the text stays content)
            spans.append(match.span())
            if self.parallel or not found:
                found.append(ToolCall(self._call_id(len(found)), call["name"], json.dumps(arguments, ensure_ascii=False)))
        if not found:
            return text, []
        # the text without its calls, less trailing whitespace: what a stream sends as content
        kept, at = [], 0
        for start, end in spans:
            kept.append(text[at:start])
            at = end
        content = ("".join(kept) + text[at:]).rstrip()
        return content or None, found

    def text_before_calls(self, text: str) -> int:
        """How much of ``text`` (an answer so far) is content for sure: up to its first
        ``<tool_call>``, or up to a tail that may yet become one; trailing whitespace waits
        too (the content of an answer with calls ends without it, streamed or not)."""
        start = text.find(_OPEN_TAG)
        if start < 0:
            start = len(text)
            for keep in range(min(len(_OPEN_TAG) - 1, len(text)), 0, -1):
                if _OPEN_TAG.startswith(text[-keep:]):
                    start = len(text) - keep
                    break
        return len(text[:start].rstrip())

    def _call_id(self, i: int) -> str:
        while len(self.call_ids) <= i:
            self.call_ids.append(new_call_id())
        return self.call_ids[i]

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The answer's ``message`` and its finish reason."""
        content, calls = self.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason

    # -- the prompt --------------------------------------------------------------------
    def template_tools(self) -> list[dict[str, Any]]:
        return [t.as_openai() for t in self.tools]


def parse_message_tool_calls(value: Any) -> tuple[dict[str, Any], ...] | None:
    """An assistant message's ``tool_calls`` in the history: ``[{"id", "type": "function",
    "function": {"name", "arguments"}}]`` (``[]`` is none)."""
    if value is None or isinstance(value, tuple):
        return value or None
    if not isinstance(value, list):
        raise ValueError("tool_calls must be a list of function calls")
    calls = []
    for i, call in enumerate(value):
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ValueError(f"tool_calls[{i}] must be a call of type 'function'")
        extra = sorted(set(call) - {"id", "type", "function"})
        if extra:
            raise ValueError(f"unsupported parameter in tool_calls[{i}]: {extra[0]}")
        function = call.get("function")
        if (
            not isinstance(call.get("id"), str)
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
            or set(function) - {"name", "arguments"}
        ):
            raise ValueError(f'tool_calls[{i}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}} with string values')
        calls.append({"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": function["arguments"]}})
    return tuple(calls) or None


_FUNCTION = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
        "description": {"type": "string"},
        "parameters": {"type": "object"},
        "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    },
    "required": ["name"],
    "additionalProperties": False,
}
TOOLS_SCHEMA = {
    "anyOf": [
        {
            "type": "array",
            "maxItems": MAX_TOOLS,
            "items": {
                "type": "object",
                "properties": {"type": {"const": "function"}, "function": _FUNCTION},
                "required": ["type", "function"],
                "additionalProperties": False,
            },
        },
        {"type": "null"},
    ]
}
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": False},
            },
            "required": ["type", "function"],
            "additionalProperties": False,
        },
        {"type": "null"},
    ]
}
MESSAGE_TOOL_CALLS_SCHEMA = {
    "anyOf": [
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string"},
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "function"],
                "additionalProperties": False,
            },
        },
        {"type": "null"},
    ]
}


def _embedded(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """``schema`` as definitions of a larger schema: itself under ``name`` and its own
    ``$defs`` (and ``definitions``) under ``<name>__<def>``, each ``$ref`` into it rewritten."""
    own = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    own_keys = {"definitions": {k for k in (schema.get("definitions") or {})}, "$defs": {k for k in (schema.get("$defs") or {})}}

    def ref(target: str) -> str:
        if not target.startswith("#"):
            return target  # a remote ref: left for the grammar library to refuse
        pointer = target[1:]
        for key in ("$defs", "definitions"):
            prefix = f"/{key}/"
            if pointer.startswith(prefix):
                head, _, rest = pointer[len(prefix) :].partition("/")
                if head in own_keys[key]:
                    return f"#/$defs/{name}__{head}" + (f"/{rest}" if rest else "")
        return f"#/$defs/{name}{pointer}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: ref(v) if k == "$ref" and isinstance(v, str) else rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    body = rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
    out = {name: body}
    out.update({f"{name}__{k}": rewrite(v) for k, v in own.items()})
    return out


def template_has_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template or "") is not None


def hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The fallback's tool instructions (the Hermes function-calling format)."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You are a function calling AI model. You are provided with function signatures within "
        "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
        "Don't make assumptions about what values to plug into functions. Here are the available tools:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "For each function call return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags as follows:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>'
    )


def render_messages(
    messages: list[dict[str, Any]], tools: ToolSet | None, chat_template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages for the chat template, and its extra arguments: ``tools`` for a template
    that renders them; else the fallback's system prompt and history."""
    if template_has_tools(chat_template):
        extra = {"tools": tools.template_tools()} if tools is not None else {}
        return [_template_message(m) for m in messages], extra
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
            continue
        if m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}, ensure_ascii=False)
                + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            text = m.get("content") or ""
            out.append({"role": m["role"], "content": f"{text}\n{calls}" if text else calls})
            continue
        out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools is not None:
        prompt = hermes_system_prompt(tools.template_tools())
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a template with its own tool format: its calls' arguments as JSON values,
    not JSON text (as vLLM's ``chat_utils._postprocess_messages`` gives them: templates write
    ``arguments | tojson`` or iterate over them)."""
    out = {**message, "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}} for c in message["tool_calls"]
        ]
    return out


def _validates(value: Any, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        return True  # llguidance compiled it: a schema jsonschema reads otherwise is not the model's fault
    return True


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
