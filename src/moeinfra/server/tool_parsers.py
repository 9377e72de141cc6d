"""DeepSeek's tool-call markup in generated text, read back as OpenAI ``tool_calls`` (what vLLM's
``deepseek_v3``, ``deepseek_v31`` and ``deepseek_v32`` tool parsers read).

* ``deepseek_v3`` (V3, V3-0324, R1): ``<｜tool▁calls▁begin｜>`` then per call
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``
  (calls separated by a newline), then ``<｜tool▁calls▁end｜>``;
* ``deepseek_v31`` (V3.1, V3.2-Exp): the same brackets, each call
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``;
* ``deepseek_v32`` (V3.2, "DSML"): ``\\n\\n<｜DSML｜function_calls>`` holding
  ``<｜DSML｜invoke name="NAME">`` blocks of ``<｜DSML｜parameter name="K" string="true|false">V
  </｜DSML｜parameter>`` (``string="true"``: V is the raw string; else JSON), closed by
  ``</｜DSML｜function_calls>``.

Text before the calls (and, for V3 / V3.1, after them) is the message's ``content``. V3 / V3.1
arguments are passed through as the model wrote them; V3.2's are built as a JSON object.

:meth:`ToolParser.parse` reads a whole output; it also reads a partial one (a stream so far),
holding back what may still become markup, so a stream's deltas are the differences between
successive parses (:class:`~moeinfra.server.chat_output.ChatOutput`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DSML_BEGIN, DSML_END = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
_INVOKE = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>')
_PARAM = re.compile(
    r'<｜DSML｜parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</｜DSML｜parameter>',
    re.DOTALL,
)
_INVOKE_END = "</｜DSML｜invoke>"


@dataclass
class Call:
    """A tool call read from text: ``arguments`` so far (complete once ``done``)."""

    name: str | None
    arguments: str = ""
    done: bool = False


@dataclass
class Parsed:
    content: str
    calls: list[Call] = field(default_factory=list)


def held_back(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def split_block(text: str, final: bool) -> tuple[str, str | None]:
    """V3 / V3.1: ``(content, the text inside the tool-call brackets or None)``; the content is
    the text around the brackets (what may still become their start held back)."""
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return text[: len(text) - (0 if final else held_back(text, CALLS_BEGIN))], None
    content, block = text[:start], text[start + len(CALLS_BEGIN) :]
    end = block.find(CALLS_END)
    if end >= 0:
        content += block[end + len(CALLS_END) :]
        block = block[:end]
    return content, block


class ToolParser:
    """Reads one tool-call format; ``final`` parses a finished output (nothing held back)."""

    name = ""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.schemas = {
            t.get("function", {}).get("name"): t.get("function", {}).get("parameters") or {}
            for t in tools or ()
        }

    def parse(self, text: str, final: bool = True) -> Parsed:
        raise NotImplementedError


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"

    def parse(self, text: str, final: bool = True) -> Parsed:
        content, block = split_block(text, final)
        if block is None:
            return Parsed(content)
        calls = [self._call(part, final) for part in block.split(CALL_BEGIN)[1:]]
        return Parsed(content, [c for c in calls if c is not None])

    @staticmethod
    def _call(part: str, final: bool) -> Call | None:
        done = CALL_END in part or final
        part = part.split(CALL_END, 1)[0]
        if SEP not in part:
            return None
        head = part.split(SEP, 1)[1]
        if "\n" not in head:  # the name is complete once its newline arrives
            return Call(head.strip(), "", True) if done else None
        name, rest = head.split("\n", 1)
        fence = "```json\n"
        if not rest.startswith(fence):
            if fence.startswith(rest) and not done:
                return Call(name.strip(), "", False)
            return Call(name.strip(), rest.strip(), done)  # not fenced: what the model wrote
        args = rest[len(fence) :]
        end = args.find("\n```")
        if end >= 0:
            args = args[:end]
        elif not done:
            args = args[: len(args) - held_back(args, "\n```")]
        return Call(name.strip(), args, done)


class DeepSeekV31Parser(ToolParser):
    name = "deepseek_v31"

    def parse(self, text: str, final: bool = True) -> Parsed:
        content, block = split_block(text, final)
        if block is None:
            return Parsed(content)
        calls = []
        for part in block.split(CALL_BEGIN)[1:]:
            if SEP not in part:
                continue
            name, args = part.split(SEP, 1)
            done = CALL_END in args or final
            args = args.split(CALL_END, 1)[0]
            if not done:
                args = args[: len(args) - held_back(args, CALL_END)]
            calls.append(Call(name.strip(), args, done))
        return Parsed(content, calls)


class DeepSeekV32Parser(ToolParser):
    name = "deepseek_v32"

    def parse(self, text: str, final: bool = True) -> Parsed:
        start = text.find(DSML_BEGIN)
        if start < 0:
            keep = len(text) - (0 if final else held_back(text, "\n\n" + DSML_BEGIN))
            return Parsed(text[:keep])
        content = text[:start].removesuffix("\n\n")
        block = text[start + len(DSML_BEGIN) :].split(DSML_END, 1)[0]
        calls = []
        for match in _INVOKE.finditer(block):
            body = block[match.end() :]
            done = _INVOKE_END in body
            body = body.split(_INVOKE_END, 1)[0]
            schema = self.schemas.get(match.group(1)) or {}
            values = [
                (key, self._value(raw, kind == "true", schema.get("properties", {}).get(key)))
                for key, kind, raw in _PARAM.findall(body)
            ]
            args = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: "
                                   f"{json.dumps(v, ensure_ascii=False)}" for k, v in values)  # fmt: skip
            calls.append(Call(match.group(1), args + "}" if done or final else args, done))
        return Parsed(content, calls)

    @staticmethod
    def _value(raw: str, is_string: bool, schema: dict | None):
        """A parameter's value: the raw text when ``string="true"`` (or the tool's schema says
        string), else its JSON (the raw text when it is not JSON)."""
        if is_string or (schema or {}).get("type") == "string":
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (DeepSeekV3Parser, DeepSeekV31Parser, DeepSeekV32Parser)
}
