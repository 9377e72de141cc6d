"""Structured output, tool calls and thinking end to end on the tiny random checkpoint: its output
under a JSON schema parses and validates; ``tool_choice`` required / named returns calls whose
arguments follow each tool's schema; with thinking on, the grammar starts after ``</think>`` and
an answer shaped as a DeepSeek-V3 tool call comes back as ``reasoning_content`` and
``tool_calls``, streamed too; the chat template writes the request's tools."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from .conftest import ServerProcess

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["kv", "moe", "eplb"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_bpe):
    srv = ServerProcess(["--model", str(tiny_bpe), "--colocated-units", "1",
                         "--prefill-units", "0", "--decode-units", "0", "--colocated-ranks", "1",
                         "--block-size", "16", "--num-kv-blocks", "256",
                         "--chat-template", "deepseek_v3_tools",
                         "--tool-call-parser", "deepseek_v3", "--enable-auto-tool-choice",
                         "--reasoning-parser", "deepseek_v3"])  # fmt: skip
    yield srv
    assert srv.stop() == 0, "".join(srv.log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_parses_and_validates(client, seed):
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=800, temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # the grammar completed
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    obj = client.completions.create(
        model="tiny", prompt="JSON:", max_tokens=300, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert isinstance(json.loads(obj.choices[0].text), dict)


def test_structured_outputs_choice_and_regex(server):
    body = {"model": "tiny", "prompt": "Pick:", "max_tokens": 20, "temperature": 1.0, "seed": 4}
    got = httpx.post(f"{server.url}/v1/completions", timeout=60,
                     json=body | {"structured_outputs": {"choice": ["kv cache", "experts"]}})  # fmt: skip
    assert got.json()["choices"][0]["text"] in ("kv cache", "experts")
    got = httpx.post(f"{server.url}/v1/completions", timeout=60,
                     json=body | {"guided_regex": "[0-9]{3}-[a-z]{2}"})  # fmt: skip
    text = got.json()["choices"][0]["text"]
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-"
    bad = httpx.post(f"{server.url}/v1/completions", timeout=60,
                     json=body | {"guided_regex": "[a-", "response_format": {"type": "text"}})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
    two = body | {"guided_regex": "a", "structured_outputs": {"regex": "b"}}
    assert httpx.post(f"{server.url}/v1/completions", json=two).status_code == 400


def test_required_and_named_tool_choice_return_valid_calls(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    reply = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=800,
        temperature=1.0,
        seed=3,
    )  # fmt: skip (one call: the array is bounded, so the grammar completes)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    named = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=400, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas["get_weather"])
    assert named.choices[0].finish_reason == "stop"


# An answer shaped as one DeepSeek-V3 tool call after a few words
CALL_SHAPE = (
    r"[a-z ]{1,8}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    r"```json\n\{\"city\": \"[a-z]{1,8}\", \"days\": [1-7]\}\n```<｜tool▁call▁end｜>"
    r"<｜tool▁calls▁end｜>"
)


def test_thinking_then_an_auto_tool_call_read_end_to_end_and_streamed(server, client):
    """Thinking on (V3.1 / V3.2's switch): the template opens <think>, the output thinks freely
    until </think> (made likely here by a bias: the random model would not write it), then the
    grammar shapes the answer; the reasoning parser and the tool parser read it back."""
    think_end = httpx.post(f"{server.url}/tokenize", json={"prompt": "</think>",
                                                          "add_special_tokens": False})  # fmt: skip
    (end_id,) = think_end.json()["tokens"]
    extra = {"structured_outputs": {"regex": CALL_SHAPE}, "logit_bias": {str(end_id): 100},
             "chat_template_kwargs": {"thinking": True}}  # fmt: skip
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=1.0,
                  seed=5, extra_body=extra)  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    message = choice.model_dump()["message"]
    assert message["reasoning_content"] == message["reasoning"] == ""  # </think> came first
    assert message["content"] and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"}
    content, arguments, names, finish = "", "", [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.model_dump()
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or ():
            names += [part["function"]["name"]] if part["function"].get("name") else []
            arguments += part["function"]["arguments"] or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == message["content"] and names == ["get_weather"]
    assert json.loads(arguments) == args and finish == "tool_calls"
    # thinking off: no reasoning field, the grammar shapes the output from its first token
    extra["chat_template_kwargs"] = {"thinking": False}
    plain = client.chat.completions.create(**kwargs).choices[0]
    assert plain.model_dump()["message"].get("reasoning_content") is None
    assert plain.message.tool_calls and plain.finish_reason == "tool_calls"
    kwargs["extra_body"] = extra | {"chat_template_kwargs": {"thinking": True},
                                    "include_reasoning": False}  # fmt: skip
    hidden = client.chat.completions.create(**kwargs)
    assert "reasoning_content" not in hidden.choices[0].message.model_dump(exclude_none=True)


def test_the_chat_template_writes_the_tools(server):
    body = {"messages": ASK, "tools": [WEATHER, TIME]}
    ids = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "### get_weather" in text and '"maxLength": 10' in text and "### get_time" in text
