"""Every request field vLLM's OpenAI server knows is honoured with vLLM's meaning or refused with a
400 naming it; log-probabilities (completions, chat, prompt) in vLLM's shapes and equal to
``transformers``' on the same checkpoint (float32), through a disaggregated server (prompt
log-probabilities come from the prefill unit, the rest from the decode unit)."""

from __future__ import annotations

import math
import time

import httpx
import openai
import pytest
import torch

from moeinfra.server.protocol import REFUSED

from .conftest import ServerProcess, metric, wait_until

TOL = 2e-4  # float32 logits within 1e-4 of transformers' (tests/engine/test_reference.py)


@pytest.fixture(scope="module")
def server(tiny_bpe):
    srv = ServerProcess(["--model", str(tiny_bpe), "--prefill-ranks", "1", "--decode-ranks", "1",
                         "--block-size", "16", "--num-kv-blocks", "256", "--max-num-seqs", "8"])  # fmt: skip
    yield srv
    assert srv.stop() == 0, "".join(srv.log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_bpe):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_bpe), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_bpe))
    return model.eval(), tokenizer


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)


def _log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_and_logprobs_score_a_prompt_as_lm_eval_asks(server, hf):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs=1, max_tokens=1;
    it sums ``token_logprobs[ctxlen:-1]`` and checks greedy against ``top_logprobs``."""
    model, tokenizer = hf
    ids = tokenizer("The decode unit runs EP144 with 32 redundant experts")["input_ids"]
    body = {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _log_softmax(model, ids)
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < TOL
        top = lp["top_logprobs"][i]
        assert lp["tokens"][i] in top and len(top) in (1, 2)
        best = int(ref[i - 1].argmax())
        assert abs(max(top.values()) - ref[i - 1, best].item()) < TOL
    assert abs(lp["token_logprobs"][-1] - ref[-1].max().item()) < TOL  # greedy: the top token
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids) + 1)]
    assert choice["text"].startswith(tokenizer.decode(ids))
    # max_tokens 0 with echo: the prompt scored, nothing generated
    body |= {"max_tokens": 0, "logprobs": 0}
    scored = _post(server, "/v1/completions", body).json()
    only = scored["choices"][0]
    assert len(only["logprobs"]["tokens"]) == len(ids) and scored["usage"]["completion_tokens"] == 0
    assert only["logprobs"]["token_logprobs"][1:] == lp["token_logprobs"][1 : len(ids)]
    assert all(len(t) == 1 for t in only["logprobs"]["top_logprobs"][1:])


def test_prompt_logprobs_in_vllms_shape(server, hf):
    model, tokenizer = hf
    ids = tokenizer("Expert parallelism spreads the experts over GPUs")["input_ids"]
    body = {"prompt": ids, "prompt_logprobs": 3, "max_tokens": 2}
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    ref = _log_softmax(model, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for i, entry in enumerate(entries[1:], start=1):
        keys = list(entry)
        assert keys[0] == str(ids[i])  # the prompt's token first, then the top 3
        assert abs(entry[keys[0]]["logprob"] - ref[i - 1, ids[i]].item()) < TOL
        assert entry[keys[0]]["decoded_token"] == tokenizer.decode([ids[i]])
        top = ref[i - 1].topk(3).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2, 3]
    assert choice["logprobs"] is None


def test_chat_logprobs_carry_bytes_and_the_exact_top_tokens(server, hf):
    model, tokenizer = hf
    messages = [{"role": "user", "content": "What does the decode unit do?"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = _post(server, "/v1/chat/completions", body).json()
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 6
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == choice["message"]["content"]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    generated = choice["token_ids"]
    assert r["prompt_token_ids"] == prompt and len(generated) == 6
    ref = _log_softmax(model, prompt + generated)
    for j, item in enumerate(content):
        row = ref[len(prompt) - 1 + j]
        assert abs(item["logprob"] - row[generated[j]].item()) < TOL
        tops = [t["logprob"] for t in item["top_logprobs"]]
        assert max(abs(a - b) for a, b in zip(tops, row.topk(3).values.tolist(), strict=True)) < TOL


def test_streamed_logprobs_equal_the_whole_response(client):
    kwargs = dict(model="tiny", prompt="KV cache", max_tokens=8, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True)]
    tokens = [t for lp in chunks if lp for t in lp.tokens]
    values = [v for lp in chunks if lp for v in lp.token_logprobs]
    assert tokens == whole.tokens and values == whole.token_logprobs


def test_stop_token_ids_stop_reason_and_include_stop_str(server):
    base = {"prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    plain = _post(server, "/v1/completions", base).json()["choices"][0]
    assert plain["finish_reason"] == "length" and plain["stop_reason"] is None
    stop = plain["token_ids"][3]
    cut = _post(server, "/v1/completions", base | {"stop_token_ids": [stop]}).json()["choices"][0]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop)
    assert cut["token_ids"][-1] == stop and plain["text"].startswith(cut["text"])
    word = plain["text"][len(plain["text"]) // 2 :][:3]
    for include in (False, True):
        body = base | {"stop": [word], "include_stop_str_in_output": include}
        got = _post(server, "/v1/completions", body).json()["choices"][0]
        assert got["stop_reason"] == word and got["text"].endswith(word) == include


def test_penalties_and_bias_reach_the_engine(server):
    """Each changes greedy output (the engine's processors are checked against transformers in
    tests/engine/test_logprobs_penalties.py); a bias of -100 bans a token."""
    base = {"prompt": "x", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    plain = _post(server, "/v1/completions", base).json()["choices"][0]["token_ids"]
    for extra in (
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"logit_bias": {str(plain[0]): -100}},
        {"allowed_token_ids": [5, 6, 7]},
    ):
        got = _post(server, "/v1/completions", base | extra).json()["choices"][0]["token_ids"]
        assert got != plain, extra
    banned = _post(server, "/v1/completions", base | {"logit_bias": {str(plain[0]): -100}})
    assert plain[0] not in banned.json()["choices"][0]["token_ids"]
    restricted = _post(server, "/v1/completions", base | {"allowed_token_ids": [5, 6, 7]})
    assert set(restricted.json()["choices"][0]["token_ids"]) <= {5, 6, 7}
    bad = _post(server, "/v1/completions", base | {"logit_bias": {"99999": 1}})
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]


def test_chat_content_parts_template_kwargs_and_continue_final_message(server, hf):
    _, tokenizer = hf
    parts = [{"type": "text", "text": "What does"}, {"type": "text", "text": "the unit do?"}]
    joined = [{"role": "user", "content": "What does\nthe unit do?"}]
    as_parts = [{"role": "user", "content": parts}]
    a = _post(server, "/tokenize", {"messages": as_parts}).json()["tokens"]
    assert a == _post(server, "/tokenize", {"messages": joined}).json()["tokens"]
    body = {"messages": as_parts, "max_tokens": 3, "temperature": 0}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(a)
    # a half-written answer continued, as transformers renders it
    history = joined + [{"role": "assistant", "content": "The unit"}]
    expected = tokenizer.apply_chat_template(history, continue_final_message=True, tokenize=True)
    expected = list(getattr(expected, "input_ids", expected))
    body = {"messages": history, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 2, "return_token_ids": True, "echo": True}  # fmt: skip
    r = _post(server, "/v1/chat/completions", body).json()
    assert r["prompt_token_ids"] == expected
    assert r["choices"][0]["message"]["content"].startswith("The unit")  # echo
    no_prompt = _post(server, "/tokenize", {"messages": joined, "add_generation_prompt": False})
    assert len(no_prompt.json()["tokens"]) < len(a)  # without the assistant's opening tag
    kwargs = {"messages": joined, "chat_template_kwargs": {"tokenize": True}}
    assert _post(server, "/v1/chat/completions", kwargs).status_code == 400


@pytest.mark.parametrize(("name", "default", "_why"), REFUSED)
def test_every_field_not_implemented_is_refused_by_name(server, name, default, _why):
    value = {"use_beam_search": True, "length_penalty": 2.0, "priority": 1}.get(name, {"x": 1})
    path = "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, name: value}
    if name in ("suffix", "prompt_embeds"):
        path, body = "/v1/completions", {"prompt": "hi", "max_tokens": 1, name: "x"}
    r = _post(server, path, body)
    assert r.status_code == 400, (name, r.text)
    assert r.json()["error"]["param"] == name


def test_odd_values_and_unknown_fields(server):
    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _post(server, "/v1/chat/completions", hi | {"n": 0}).status_code == 400
    assert _post(server, "/v1/chat/completions", hi | {"best_of": 3}).status_code == 400
    assert _post(server, "/v1/chat/completions", hi | {"best_of": 1}).status_code == 200
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    auto = _post(server, "/v1/chat/completions", hi | {"tools": [tool]})  # auto: no parser here
    assert auto.status_code == 400 and auto.json()["error"]["param"] == "tool_choice"
    ok = _post(server, "/v1/chat/completions", hi | {"some_field_no_server_knows": 1})
    assert ok.status_code == 200  # ignored with a warning, as vLLM does
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    streamed_prompt_lp = {"prompt": "hi", "stream": True, "prompt_logprobs": 1}
    assert _post(server, "/v1/completions", streamed_prompt_lp).status_code == 400
    named = _post(server, "/v1/completions", {"prompt": "hi", "request_id": "abc", "max_tokens": 1})
    assert named.json()["id"] == "cmpl-abc"
    ids = _post(server, "/v1/completions", {"prompt": "hello world", "logprobs": 0, "max_tokens": 2,
                                            "return_tokens_as_token_ids": True}).json()  # fmt: skip
    assert all(t.startswith("token_id:") for t in ids["choices"][0]["logprobs"]["tokens"])
    long = {"prompt": "x " * 50, "truncate_prompt_tokens": 7, "max_tokens": 1}
    assert _post(server, "/v1/completions", long).json()["usage"]["prompt_tokens"] == 7


def test_info_endpoints(server, tiny_bpe):
    models = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert models["root"] == str(tiny_bpe) and models["max_model_len"] > 0
    from importlib.metadata import version

    assert httpx.get(f"{server.url}/version").json() == {"version": version("moeinfra")}
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<｜end▁of▁sentence｜>" and "chat_template" in info
    assert math.isfinite(info["model_max_length"])


def test_a_body_over_the_cap_is_a_413(server):
    big = b'{"model": "tiny", "prompt": "' + b"x" * (33 << 20) + b'"}'
    r = httpx.post(f"{server.url}/v1/completions", content=big, timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: refused once the body passes the cap
        yield big[: 1 << 20]
        for start in range(1 << 20, len(big), 1 << 22):
            yield big[start : start + (1 << 22)]

    r = httpx.post(f"{server.url}/v1/completions", content=chunked(), timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413


def test_a_huge_prompt_is_tokenised_off_the_event_loop(server):
    """While a 4 MB prompt is being tokenised (about a second), /health still answers: it is
    answered before the huge request is (which then fails its length check)."""
    import concurrent.futures as cf

    text = "The decode unit runs EP144 with 32 redundant experts. " * 75_000
    finished = {}

    def huge():
        r = _post(server, "/v1/completions", {"prompt": text, "max_tokens": 1})
        finished["huge"] = time.monotonic()
        return r

    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(huge)
        time.sleep(0.5)  # the body is in; the server is tokenising
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        answered = time.monotonic()
        assert pending.result().status_code == 400  # over max_model_len
    assert answered < finished["huge"]


def test_metrics_under_vllms_names_too(server):
    r = _post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    labels = 'model_name="tiny"'
    for name in (
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
    ):
        assert metric(server.url, name, labels) > 0 or f"{name}{{" in text, name
    assert metric(server.url, "vllm:request_success_total", 'finished_reason="length"') >= 1
    wait_until(lambda: metric(server.url, "moeinfra:kv_transfer_sent_bytes_total") > 0)
    assert "# TYPE moeinfra:kv_transfer_received_bytes_total counter" in text
