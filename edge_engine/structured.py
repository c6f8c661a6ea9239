"""``response_format``, ``tools`` and ``tool_choice``: checked, then turned into the grammar the
output must follow and the prompt that tells the model about its tools.

The checks on a field's shape (``check_response_format``, ``check_tools``,
``check_tool_choice``) are ``openai_fields``' to run, wherever a request is read; ``plan``
then reads a well-formed body into a ``StructuredPlan`` (and checks what spans fields: a
``tool_choice`` naming a tool the request lacks).

The grammar (llguidance's Lark dialect, a JSON schema inside ``%json``):

- ``json_object``: any JSON object; ``json_schema``: its ``schema``. An object schema that
  declares ``properties`` but not ``additionalProperties`` allows no other keys (xgrammar's
  and vLLM's default; with ``strict: true`` every object schema, as OpenAI's strict mode
  requires); a number without bounds stays within +-(2**53 - 1) (I-JSON), with at most 6
  decimals, and a free string without ``maxLength`` within 512 characters. With ``strict: true`` a keyword the library does not implement is refused with
  400; without it, such a keyword is ignored (JSON Schema's own rule for unknown ones).
- tools, in SmolLM2's function-calling format (its model card; its chat template has no
  tool support, so the tools go into the system prompt): the model answers
  ``<tool_call>[\\n{"name": "NAME", "arguments": {...}},\\n...\\n]</tool_call>``, each call's
  ``arguments`` following that function's ``parameters`` schema. ``tool_choice``:
  ``"required"`` = the output is that tool-call block; a named function = the block with
  exactly one call of it; ``"auto"`` (the default with tools) = plain text (or the
  ``response_format`` answer), optionally followed by the block -- once the model writes
  ``<tool_call>`` the rest is held to the grammar; ``"none"`` = no tools in the prompt, no
  tool grammar. ``parallel_tool_calls: false`` = at most one call.

JSON is laid out with ", " and ": " and no other whitespace (``grammar.JSON_OPTIONS``).
No torch and no grammar library here: text in, text out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError

__all__ = [
    "StructuredPlan",
    "ToolSpec",
    "TOOL_CALL_BEGIN",
    "TOOL_CALL_END",
    "check_response_format",
    "check_tool_choice",
    "check_tools",
    "plan",
    "render_tool_calls",
    "tools_system_prompt",
]

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_OPEN = "[\n"
TOOL_CALL_SEP = ",\n"
TOOL_CALL_CLOSE = "\n]</tool_call>"
TOOL_CALL_END = "</tool_call>"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_FORMATS = ("text", "json_object", "json_schema")


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param, code)


# -- field shapes (run by openai_fields.check_request) -----------------------------------
def check_response_format(value: Any) -> None:
    if not isinstance(value, dict):
        raise _bad("response_format must be an object", "response_format", "invalid_type")
    kind = value.get("type")
    if kind not in _FORMATS:
        raise _bad(f"response_format.type must be one of {', '.join(_FORMATS)}, got {kind!r}", "response_format.type")
    if kind != "json_schema":
        return
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad(
            "response_format.json_schema is required with type json_schema (an object with a schema)",
            "response_format.json_schema",
            "missing_required_parameter" if spec is None else "invalid_type",
        )
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
        raise _bad("response_format.json_schema.name must match ^[a-zA-Z0-9_-]{1,64}$", "response_format.json_schema.name")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _bad(
            "response_format.json_schema.schema must be a JSON Schema object",
            "response_format.json_schema.schema",
            "missing_required_parameter" if schema is None else "invalid_type",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict", "invalid_type")


def check_tools(value: Any) -> None:
    if not isinstance(value, list):
        raise _bad("tools must be an array of tools", "tools", "invalid_type")
    if len(value) > 128:
        raise _bad("tools may have at most 128 entries", "tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools.[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where, "invalid_type")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type must be 'function'", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function is required (an object)", f"{where}.function", "missing_required_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$", f"{where}.function.name")
        if name in names:
            raise _bad(f"{where}.function.name {name!r} is used by another tool", f"{where}.function.name")
        names.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{where}.function.description must be a string", f"{where}.function.description", "invalid_type")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise _bad(f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters", "invalid_type")
            if params.get("type", "object") != "object":
                raise _bad(f"{where}.function.parameters must describe an object (type: object)", f"{where}.function.parameters")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"{where}.function.strict must be a boolean", f"{where}.function.strict", "invalid_type")


def check_tool_choice(value: Any) -> None:
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _bad(f"tool_choice must be 'none', 'auto', 'required' or a function, got {value!r}", "tool_choice")
        return
    if not isinstance(value, dict) or value.get("type") != "function":
        raise _bad("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", ...}", "tool_choice", "invalid_type")
    fn = value.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad("tool_choice.function.name is required", "tool_choice.function.name", "missing_required_parameter")


# -- the plan --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict
    strict: bool

    def as_prompt(self) -> dict:
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["parameters"] = self.parameters
        return out


@dataclass(frozen=True, slots=True)
class StructuredPlan:
    """What a request asks of the output beyond plain text."""

    format: str = "text"  # response_format.type
    schema: dict | None = None  # json_schema's schema (json_object: None)
    strict: bool = False
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"  # "none" | "auto" | "required" | "function" (then ``function``)
    function: str | None = None
    parallel_tool_calls: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def calls_only(self) -> bool:
        """The output is a tool-call block and nothing else."""
        return self.uses_tools and self.tool_choice in ("required", "function")

    @property
    def is_constrained(self) -> bool:
        return self.format != "text" or self.uses_tools

    def grammar(self) -> str:
        """The Lark grammar of the output (call only when ``is_constrained``)."""
        lines = ["%llguidance {}"]
        answer = self._answer_rule(lines)
        if not self.uses_tools:
            lines.insert(1, "start: answer")
            return "\n".join(lines) + "\n"
        calls = self._calls_rules(lines)
        if self.calls_only:
            start = f"start: {json.dumps(TOOL_CALL_BEGIN)} {calls}"
        elif answer:
            start = f"start: answer | {json.dumps(TOOL_CALL_BEGIN)} {calls}"
        else:
            # text, or text then the block: the lazy prefix ends at the first <tool_call>,
            # after which the block's grammar holds
            start = f"start: TEXT | prefix {calls}"
            lines += [f"prefix[lazy]: ANY {json.dumps(TOOL_CALL_BEGIN)}", "TEXT: /(?s:.+)/", "ANY: /(?s:.*)/"]
        lines.insert(1, start)
        return "\n".join(lines) + "\n"

    def _answer_rule(self, lines: list[str]) -> bool:
        if self.format == "text":
            return False
        schema = self.schema if self.format == "json_schema" else {"type": "object"}
        lines.append("answer: %json " + json.dumps(_compile_ready(schema, self.strict)))
        return True

    def _calls_rules(self, lines: list[str]) -> str:
        tools = [t for t in self.tools if self.function is None or t.name == self.function]
        alternatives = []
        for i, tool in enumerate(tools):
            head = json.dumps('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
            lines.append(f"args_{i}: %json " + json.dumps(_compile_ready(tool.parameters, tool.strict)))
            alternatives.append(f"{head} args_{i} \"}}\"")
        lines.append("call: " + " | ".join(alternatives))
        one = self.function is not None or not self.parallel_tool_calls
        repeat = "" if one else f" ({json.dumps(TOOL_CALL_SEP)} call)*"
        lines.append(f"calls: {json.dumps(TOOL_CALL_OPEN)} call{repeat} {json.dumps(TOOL_CALL_CLOSE)}")
        return "calls"

    def part_grammars(self) -> list[tuple[str, str]]:
        """(param, grammar) for each schema the grammar holds, alone: once the whole grammar
        fails to compile, the first of these that fails names the part at fault."""
        parts = []
        if self.format == "json_schema" and self.schema is not None:
            parts.append(("response_format.json_schema.schema", self.schema, self.strict))
        if self.uses_tools:
            parts += [(f"tools.[{i}].function.parameters", t.parameters, t.strict) for i, t in enumerate(self.tools)]
        return [
            (param, "%llguidance {}\nstart: answer\nanswer: %json " + json.dumps(_compile_ready(schema, strict)) + "\n")
            for param, schema, strict in parts
        ]


def _compile_ready(schema: dict, strict: bool) -> dict:
    """``schema`` with the layout options attached, undeclared keys refused and integers
    bounded by default."""
    schema = _edge_defaults(schema, strict)
    options = {**JSON_OPTIONS, "lenient": not strict}
    return {**schema, "x-guidance": options}


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # not allOf: its parts together declare the keys
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


SAFE_INTEGER = 2**53 - 1  # I-JSON (RFC 7493): the integers every JSON reader holds exactly
NUMBER_STEP = 1e-6  # a number without multipleOf: at most 6 decimals
MAX_STRING_CHARS = 512  # a free string without maxLength: at most this many characters
_FREE_STRING_KEYS = ("maxLength", "enum", "const", "pattern", "format")


def _edge_defaults(schema: Any, strict: bool, depth: int = 0) -> Any:
    """A copy of ``schema`` with two defaults that keep a small model's output sane, both
    still valid against the schema:

    - object schemas that declare ``properties`` (with ``strict``: all object schemas)
      default ``additionalProperties`` to false, as xgrammar's and vLLM's default does and
      OpenAI's strict mode requires: a small model left free to add keys adds them;
    - a number without bounds is held to I-JSON's range, +-(2**53 - 1), and without
      ``multipleOf`` to 6 decimals; a free string without ``maxLength`` to
      ``MAX_STRING_CHARS``: on the 50-schema bench SmolLM2 otherwise wrote
      "12345678901234567890...", "1.000000..." or "1.1.1.1..." until max_tokens (6 of 50
      answers cut short, invalid). A schema's own bounds stand.
    """
    if not isinstance(schema, dict) or depth > 64:
        return schema
    out = dict(schema)
    kind = out.get("type")
    if kind in ("integer", "number"):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
        if kind == "number" and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    elif kind == "string" and not any(key in out for key in _FREE_STRING_KEYS):
        out["maxLength"] = MAX_STRING_CHARS
    kind = out.get("type")
    is_object = "properties" in out or (strict and (kind == "object" or (isinstance(kind, list) and "object" in kind)))
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _edge_defaults(v, strict, depth + 1) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_edge_defaults(v, strict, depth + 1) for v in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = _edge_defaults(out[key], strict, depth + 1)
    return out


def plan(body: dict) -> StructuredPlan | None:
    """The structured-output plan of a well-formed chat body; None: plain text."""
    response_format = body.get("response_format") or {"type": "text"}
    raw_tools = body.get("tools") or []
    if response_format.get("type", "text") == "text" and not raw_tools:
        if isinstance(body.get("tool_choice"), dict) or body.get("tool_choice") == "required":
            raise _bad("tool_choice needs tools: the request has none", "tool_choice")
        return None
    schema, strict = None, False
    if response_format["type"] == "json_schema":
        spec = response_format["json_schema"]
        schema, strict = spec["schema"], spec.get("strict") is True
    tools = tuple(
        ToolSpec(
            name=t["function"]["name"],
            description=t["function"].get("description"),
            parameters=t["function"].get("parameters") or {"type": "object", "properties": {}},
            strict=t["function"].get("strict") is True,
        )
        for t in raw_tools
    )
    choice = body.get("tool_choice")
    function = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        function = choice["function"]["name"]
        if function not in {t.name for t in tools}:
            raise _bad(f"tool_choice names the function {function!r}, which is not in tools", "tool_choice.function.name")
        choice = "function"
    elif choice in ("required", "auto") and not tools:
        if choice == "required":
            raise _bad("tool_choice is 'required' but the request has no tools", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    return StructuredPlan(
        format=response_format["type"],
        schema=schema,
        strict=strict,
        tools=tools,
        tool_choice=choice,
        function=function,
        parallel_tool_calls=parallel is not False,
    )


# -- the prompt ------------------------------------------------------------------------
_TOOLS_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "{when} output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct.\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "... (more tool calls as required)\n]</tool_call>"
)
_WHEN_AUTO = "If no function call is needed, answer in plain text.\nWhen you call functions, the"
_WHEN_REQUIRED = "You must call a function: the"


def tools_system_prompt(plan: StructuredPlan) -> str:
    """SmolLM2's function-calling system prompt (its model card's, with the sentence on
    answering without a call fitted to ``tool_choice``) listing the plan's tools."""
    listed = json.dumps([t.as_prompt() for t in plan.tools], ensure_ascii=False)
    when = _WHEN_REQUIRED if plan.calls_only else _WHEN_AUTO
    return _TOOLS_PROMPT.format(tools=listed, when=when)


def render_tool_calls(tool_calls: list[dict], param: str) -> str:
    """An assistant turn's earlier ``tool_calls`` as the text the model would have written."""
    calls = []
    for j, call in enumerate(tool_calls):
        where = f"{param}.tool_calls.[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.function.name is required", f"{where}.function.name", "missing_required_parameter")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise _bad(f"{where}.function.arguments must be a JSON string", f"{where}.function.arguments") from None
        calls.append(json.dumps({"name": fn["name"], "arguments": arguments}, ensure_ascii=False))
    return TOOL_CALL_BEGIN + TOOL_CALL_OPEN + TOOL_CALL_SEP.join(calls) + TOOL_CALL_CLOSE
