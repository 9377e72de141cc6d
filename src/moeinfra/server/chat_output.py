"""A chat choice's text read as OpenAI's message: ``reasoning`` / ``reasoning_content``,
``content`` and ``tool_calls``, whole or as streamed deltas.

``tool_choice`` decides how calls are read (vLLM's rules): ``none`` reads none; ``auto`` reads
DeepSeek's markup with the server's ``--tool-call-parser``; ``required`` constrains the output to
a JSON array of ``{"name", "parameters"}`` (at least one; one when ``parallel_tool_calls`` is
false) and a named function constrains it to that function's parameters — both through the
engine's grammar (:func:`forced_schema`). A stream's deltas are the differences between
successive readings of its text so far (each parser holds back what may still become markup),
so a streamed message adds up to the whole one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from moeinfra.server.protocol import APIError
from moeinfra.server.reasoning import REASONING_PARSERS, ReasoningParser
from moeinfra.server.tool_parsers import PARSERS, Call, Parsed, ToolParser


@dataclass(frozen=True)
class ChatOptions:
    """What ``serve up`` says about chat output: its tool-call parser (None: none), whether
    ``tool_choice: auto`` is on, its reasoning parser (None: none)."""

    tool_call_parser: str | None = None
    auto_tool_choice: bool = False
    reasoning_parser: str | None = None


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


class NamedCall(ToolParser):
    """``tool_choice`` naming one function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.function = name

    def parse(self, text: str, final: bool = True) -> Parsed:
        return Parsed("", [Call(self.function, text, final)])


class RequiredCalls(ToolParser):
    """``tool_choice: required``: a JSON array of ``{"name", "parameters"}``; a call is read once
    its element is complete."""

    def parse(self, text: str, final: bool = True) -> Parsed:
        decoder, calls = json.JSONDecoder(), []
        at = text.find("[") + 1
        while 0 < at < len(text):
            while at < len(text) and text[at] in " \t\n\r,":
                at += 1
            try:
                item, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                break
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                args = json.dumps(item.get("parameters") or {}, ensure_ascii=False)
                calls.append(Call(item["name"], args, True))
        return Parsed("", calls)


def resolve_tool_choice(tools: list[dict] | None, choice, options: ChatOptions):
    """``(mode, function name)`` of a request: mode ``none`` / ``auto`` / ``required`` /
    ``named``; a 400 naming ``tool_choice`` for what vLLM refuses."""
    names = [t.get("function", {}).get("name") for t in tools or ()]
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and tools is None:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise APIError(
                400,
                'tool_choice must be "none", "auto", "required" or {"type": "function", '
                '"function": {"name": ...}}',
                "tool_choice",
            )
        if name not in names:
            raise APIError(
                400,
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
        return "named", name
    if choice not in ("none", "auto", "required"):
        raise APIError(
            400,
            f'Invalid value for `tool_choice`: {choice!r}. Only named tools, "none", "auto" or '
            '"required" are supported.',
            "tool_choice",
        )
    if choice == "required" and not tools:
        return "none", None
    if choice == "auto" and not (options.auto_tool_choice and options.tool_call_parser):
        raise APIError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
            "set",
            "tool_choice",
        )
    return choice, None


def forced_schema(tools: list[dict], mode: str, name: str | None, parallel: bool) -> dict | None:
    """The JSON schema the output must follow for ``required`` / a named function (vLLM's)."""

    def parameters(tool: dict) -> dict:
        return tool.get("function", {}).get("parameters") or {"type": "object", "properties": {}}

    if mode == "named":
        return parameters(next(t for t in tools if t["function"]["name"] == name))
    if mode != "required":
        return None
    items = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class _Sent:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (id, arguments sent)


class ChatOutput:
    """Reads one choice's text (``mode``, ``function``: :func:`resolve_tool_choice`'s)."""

    def __init__(
        self,
        options: ChatOptions,
        tools: list[dict] | None,
        mode: str,
        function: str | None,
        template_kwargs: dict | None,
        parallel: bool = True,
    ) -> None:
        self.reasoning: ReasoningParser | None = None
        if options.reasoning_parser:
            self.reasoning = REASONING_PARSERS[options.reasoning_parser](template_kwargs)
        self.tools: ToolParser | None = None
        if mode == "auto":
            self.tools = PARSERS[options.tool_call_parser](tools)
        elif mode == "required":
            self.tools = RequiredCalls()
        elif mode == "named":
            self.tools = NamedCall(function)
        self.mode, self.parallel = mode, parallel
        self.text = ""
        self._sent = _Sent()

    def read(self, text: str, final: bool = True) -> tuple[str | None, str, list[Call]]:
        """(reasoning or None, content, tool calls) of ``text``."""
        reasoning, answer = (
            (None, text) if self.reasoning is None else self.reasoning.split(text, final)
        )
        if self.tools is None:
            return reasoning, answer, []
        parsed = self.tools.parse(answer, final)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        return reasoning, parsed.content, calls

    def message(self, text: str, role: str) -> dict:
        """The whole message of a finished choice."""
        reasoning, content, calls = self.read(text)
        message: dict = {"role": role, "content": None if calls and not content else content}
        if self.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = [
                {"id": tool_call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]  # fmt: skip
        return message

    def finish_reason(self, text: str, engine_reason: str) -> str:
        """``tool_calls`` when calls were read (``auto`` / ``required``) and the engine stopped
        normally; else the engine's reason."""
        if engine_reason == "stop" and self.mode in ("auto", "required") and self.read(text)[2]:
            return "tool_calls"
        return engine_reason

    def delta(self, new_text: str, final: bool = False) -> dict:
        """The stream delta for ``new_text`` (``final``: the output ended; flush what was
        held back). Empty when there is nothing new to show."""
        self.text += new_text
        if self.reasoning is None and self.tools is None:  # plain text: nothing to hold back
            return {"content": new_text} if new_text else {}
        reasoning, content, calls = self.read(self.text, final)
        sent, out = self._sent, {}
        if reasoning and reasoning.startswith(sent.reasoning) and reasoning != sent.reasoning:
            out["reasoning_content"] = out["reasoning"] = reasoning[len(sent.reasoning) :]
            sent.reasoning = reasoning
        if content.startswith(sent.content) and content != sent.content:
            out["content"] = content[len(sent.content) :]
            sent.content = content
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                continue
            if index == len(sent.calls):
                sent.calls.append((tool_call_id(), ""))
                deltas.append(
                    {"index": index, "id": sent.calls[index][0], "type": "function",
                     "function": {"name": call.name, "arguments": ""}}
                )  # fmt: skip
            call_id, args_sent = sent.calls[index]
            if call.arguments.startswith(args_sent) and call.arguments != args_sent:
                piece = call.arguments[len(args_sent) :]
                sent.calls[index] = (call_id, call.arguments)
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += piece
                else:
                    deltas.append({"index": index, "function": {"arguments": piece}})
        if deltas:
            out["tool_calls"] = deltas
        return out
