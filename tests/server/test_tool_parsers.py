"""DeepSeek's tool-call markup (V3, V3.1, V3.2 as DeepSeek documents it) and thinking read back as
OpenAI's message fields, whole and streamed in pieces of any size (a stream's deltas add up to the
whole message); ``tool_choice`` resolved and refused as vLLM does."""

from __future__ import annotations

import json

import pytest

from moeinfra.server.chat_output import (
    ChatOptions,
    ChatOutput,
    RequiredCalls,
    forced_schema,
    resolve_tool_choice,
)
from moeinfra.server.protocol import APIError
from moeinfra.server.reasoning import DeepSeekR1Reasoning, DeepSeekV3Reasoning
from moeinfra.server.tool_parsers import PARSERS

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

# DeepSeek-V3's format (its model card and tokenizer_config.json chat template)
V3 = (
    "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"location": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
    '```json\n{"tz": "Europe/Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
# DeepSeek-V3.1's format (its model card: no type, no fence, calls back to back)
V31 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"location": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time'
    '<｜tool▁sep｜>{"tz": "Europe/Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
# DeepSeek-V3.2's DSML format (its encoding's tool prompt): string="false" values are JSON
V32 = (
    "我来查询。\n\n<｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">杭州</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_time">\n'
    '<｜DSML｜parameter name="tz" string="true">Asia/Shanghai</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜function_calls>"
)
EXPECTED = {
    "deepseek_v3": ("Let me check.", [("get_weather", {"location": "Paris", "days": 2}),
                                      ("get_time", {"tz": "Europe/Paris"})]),
    "deepseek_v31": ("", [("get_weather", {"location": "Paris", "days": 2}),
                          ("get_time", {"tz": "Europe/Paris"})]),
    "deepseek_v32": ("我来查询。", [("get_weather", {"location": "杭州", "days": 3}),
                                   ("get_time", {"tz": "Asia/Shanghai"})]),
}  # fmt: skip
TEXTS = {"deepseek_v3": V3, "deepseek_v31": V31, "deepseek_v32": V32}


def _auto(parser: str, reasoning: str | None = None, kwargs=None) -> ChatOutput:
    options = ChatOptions(parser, True, reasoning)
    return ChatOutput(options, [WEATHER, TIME], "auto", None, kwargs)


def _streamed(output: ChatOutput, text: str, size: int) -> dict:
    """The message a client assembles from the stream's deltas (``size``-character pieces)."""
    message = {"content": "", "reasoning": "", "tool_calls": {}}
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        delta = output.delta(piece, final=i == len(pieces) - 1)
        message["content"] += delta.get("content", "")
        message["reasoning"] += delta.get("reasoning", "")
        assert delta.get("reasoning") == delta.get("reasoning_content")
        for call in delta.get("tool_calls", ()):
            slot = message["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            if "id" in call:  # the first delta of a call names it
                assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
                slot["name"] = call["function"]["name"]
                slot["id"] = call["id"]
            slot["arguments"] += call["function"]["arguments"]
    return message


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_each_format_reads_content_and_calls_whole_and_streamed(parser):
    content, calls = EXPECTED[parser]
    message = _auto(parser).message(TEXTS[parser], "assistant")
    assert (message["content"] or "") == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in message["tool_calls"]]  # fmt: skip
    assert got == calls
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert _auto(parser).finish_reason(TEXTS[parser], "stop") == "tool_calls"
    assert _auto(parser).finish_reason(TEXTS[parser], "length") == "length"
    for size in (1, 3, 17, len(TEXTS[parser])):
        streamed = _streamed(_auto(parser), TEXTS[parser], size)
        assert streamed["content"] == content, size
        assert [(c["name"], json.loads(c["arguments"])) for c in
                streamed["tool_calls"].values()] == calls, size  # fmt: skip


def test_v3_arguments_pass_through_as_written_and_text_without_calls_is_content():
    text = V3.replace('{"location": "Paris", "days": 2}', '{ "location":"Paris" ,"days":2 }')
    args = _auto("deepseek_v3").message(text, "assistant")["tool_calls"][0]["function"]
    assert args["arguments"] == '{ "location":"Paris" ,"days":2 }'
    plain = _auto("deepseek_v3").message("No tools needed.", "assistant")
    assert plain["content"] == "No tools needed." and "tool_calls" not in plain
    # a partial marker at a stream's end is shown once the stream ends
    assert _streamed(_auto("deepseek_v32"), "hello\n\n<｜DSM", 2)["content"] == "hello\n\n<｜DSM"


def test_thinking_is_split_from_the_answer():
    r1 = DeepSeekR1Reasoning()
    assert r1.split("<think>plan</think>answer") == ("plan", "answer")
    assert r1.split("plan</think>answer") == ("plan", "answer")  # <think> was in the prompt
    assert r1.split("still thinking") == ("still thinking", "")
    assert DeepSeekV3Reasoning({"thinking": True}).split("a</think>b") == ("a", "b")
    assert DeepSeekV3Reasoning({}).split("a</think>b") == (None, "a</think>b")
    text = "<think>Paris weather?</think>Checking." + V3[len("Let me check.") :]
    output = _auto("deepseek_v3", "deepseek_r1")
    message = output.message(text, "assistant")
    assert message["reasoning"] == message["reasoning_content"] == "Paris weather?"
    assert message["content"] == "Checking." and len(message["tool_calls"]) == 2
    for size in (1, 5):
        streamed = _streamed(_auto("deepseek_v3", "deepseek_r1"), text, size)
        assert streamed["reasoning"] == "Paris weather?" and streamed["content"] == "Checking."
        assert len(streamed["tool_calls"]) == 2


def test_forced_calls_read_from_json():
    required = RequiredCalls().parse('[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"na')
    assert [(c.name, json.loads(c.arguments)) for c in required.calls] == [
        ("get_time", {"tz": "UTC"})
    ]
    options = ChatOptions()
    named = ChatOutput(options, [WEATHER], "named", "get_weather", None)
    message = named.message('{"location": "Oslo"}', "assistant")
    assert message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"location": "Oslo"}'}  # fmt: skip
    assert named.finish_reason('{"location": "Oslo"}', "stop") == "stop"  # as OpenAI
    schema = forced_schema([WEATHER, TIME], "required", None, parallel=False)
    assert schema["minItems"] == schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    assert (
        forced_schema([WEATHER], "named", "get_weather", True) == WEATHER["function"]["parameters"]
    )


@pytest.mark.parametrize(
    ("tools", "choice", "options", "message"),
    [
        (None, "auto", ChatOptions("deepseek_v3", True), "`tools` must be set"),
        ([WEATHER], "sometimes", ChatOptions(), "Invalid value for `tool_choice`"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, ChatOptions(),
         "does not match any of the specified `tools`"),
        ([WEATHER], None, ChatOptions(), "--enable-auto-tool-choice"),
        ([WEATHER], "auto", ChatOptions("deepseek_v3", False), "--enable-auto-tool-choice"),
    ],
)  # fmt: skip
def test_tool_choice_refusals_name_the_field(tools, choice, options, message):
    with pytest.raises(APIError) as err:
        resolve_tool_choice(tools, choice, options)
    assert err.value.param == "tool_choice" and message in err.value.message


def test_tool_choice_defaults():
    on = ChatOptions("deepseek_v3", True)
    assert resolve_tool_choice([WEATHER], None, on) == ("auto", None)
    assert resolve_tool_choice(None, None, on) == ("none", None)
    assert resolve_tool_choice([], "required", on) == ("none", None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert resolve_tool_choice([WEATHER], named, ChatOptions()) == ("named", "get_weather")
