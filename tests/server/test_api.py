"""The OpenAI-compatible API, driven by the official ``openai`` client and by raw HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest
from tests.server.conftest import metric, wait_until

from moeinfra.engine import LLM, SamplingParams

PROMPTS = [
    "Prefill and decode are disaggregated: a prefill unit computes the KV cache",
    "Expert parallelism spreads the experts over GPUs and the all-to-all moves tokens",
    "hello world",
    "The decode unit runs EP144 with 32 redundant experts",
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_greedy_tokens_equal_one_colocated_engine(client, model, tiny_bpe):
    """Prefill on one unit, KV handed off, decode on another: the same text as one engine."""
    with LLM(tiny_bpe, block_size=16, num_kv_blocks=256) as llm:
        expected = [
            r.outputs[0].text
            for r in llm.generate(
                PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            )
        ]
    got = [
        client.completions.create(
            model=model, prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        for p in PROMPTS
    ]
    assert [g.choices[0].text for g in got] == expected
    assert all(g.usage.completion_tokens == 12 for g in got)
    assert [g.usage.prompt_tokens for g in got] == [
        len(ids) for ids in (llm.tokenizer.encode(p) for p in PROMPTS)
    ]


def test_streaming_chat_with_usage_matches_non_streaming(client, model):
    messages = [{"role": "user", "content": "What does the decode unit do?"}]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, seed=3
    )
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_every_token_is_streamed_even_before_its_text_is_complete(client, model):
    """One chunk per token, as vLLM streams: a token ending inside a UTF-8 character (15% of the
    tiny BPE's vocabulary) gets a chunk with empty text, so a client's time to first token is the
    first token's, not the first whole character's."""
    stream = client.completions.create(
        model=model,
        prompt="disaggregated",
        max_tokens=48,
        temperature=1.0,
        seed=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = [c.choices[0].text for c in stream if c.choices[0].finish_reason is None]
    assert len(texts) == 48
    assert "" in texts  # the case this test is about occurred


def test_n_choices_and_seeded_sampling_are_reproducible(client, model):
    kwargs = dict(model=model, prompt="KV cache", max_tokens=8, temperature=1.0, seed=11, n=3)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1  # each choice has its own seed


def test_cached_tokens_reported_for_a_repeated_prefix(client, model):
    prompt = " ".join(["the prefill unit writes its KV blocks to disk"] * 6)
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < again.usage.prompt_tokens


def test_models_health_and_metrics(server, client, model):
    assert model == "tiny"
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok"
    assert {(u["device"], u["dtype"]) for u in health["units"].values()} == {("cpu", "float32")}
    client.completions.create(model=model, prompt="hello", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "moeinfra:time_to_first_token_seconds_bucket",
        "moeinfra:time_per_output_token_seconds_bucket",
        "moeinfra:inter_token_latency_seconds_bucket",
        "moeinfra:unit_waiting_requests",
        "moeinfra:kv_blocks_used",
        "moeinfra:prefix_cache_hit_tokens_total",
        "moeinfra:expert_balancedness",
        'moeinfra:units_alive{role="decode"} 1.0',
        "moeinfra:kv_transfer_received_bytes_total",
    ):
        assert name in text, name
    assert metric(server.url, "moeinfra:time_to_first_token_seconds_count") >= 1
    wait_until(lambda: metric(server.url, "moeinfra:kv_transfer_received_bytes_total") > 0)


def test_tokenize_and_detokenize_as_vllm_serves_them(server, tiny_bpe):
    """vLLM's ``/tokenize`` and ``/detokenize`` (what ``vllm bench serve`` and other clients call),
    checked against ``transformers``' tokenizer of the same checkpoint."""
    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_bpe))
    text = PROMPTS[0]
    r = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert r["tokens"] == ref(text)["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0 and r["token_strs"] is None
    r = httpx.post(
        f"{server.url}/tokenize",
        json={"prompt": text, "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert r["tokens"] == ref(text, add_special_tokens=False)["input_ids"]
    assert r["token_strs"] == ref.convert_ids_to_tokens(r["tokens"])
    messages = [{"role": "user", "content": "Hello!"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert r["tokens"] == list(getattr(expected, "input_ids", expected))
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": ref.decode(r["tokens"])}
    for path, body, param in (
        ("/tokenize", {"model": "nope", "prompt": "x"}, "model"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ):
        reply = httpx.post(f"{server.url}{path}", json=body)
        assert reply.status_code in (400, 404) and reply.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "n": 9}, 400, "n"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": "tiny", "prompt": "x " * 5000, "max_tokens": 1}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny"}, 400, "prompt"),
        ({"model": "tiny", "prompt": [10**9]}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_style_4xx(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_malformed_json_is_a_400(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-none", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-5)


def test_client_disconnect_aborts_the_request_everywhere(server, model):
    body = {
        "model": model,
        "prompt": "hello",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # leave mid-stream
    wait_until(lambda: metric(server.url, "moeinfra:requests_in_flight") == 0)
    wait_until(lambda: metric(server.url, "moeinfra:unit_running_requests") == 0, timeout_s=5)
    assert metric(server.url, "moeinfra:requests_total", 'finish_reason="abort"') >= 1


def test_a_full_system_answers_503_with_retry_after(server, model):
    """Capacity is 8 decode slots + a queue of 4: the 13th concurrent request is refused."""
    import concurrent.futures as cf

    body = {"model": model, "prompt": "hello", "max_tokens": 400, "ignore_eos": True}

    def post(_):
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

    with cf.ThreadPoolExecutor(16) as pool:
        codes = [r for r in pool.map(post, range(16))]
    refused = [r for r in codes if r.status_code == 503]
    assert refused and len(refused) <= 4
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert all(r.json()["error"]["code"] == "overloaded" for r in refused)
    assert sum(r.status_code == 200 for r in codes) >= 12


def test_trace_prompts_share_the_same_blocks_under_every_seed(tmp_path):
    from moeinfra.server.bench import synthetic_trace, trace_requests

    trace = synthetic_trace(tmp_path / "t.jsonl", 40, 2.0, block_tokens=16, seed=2)

    def opens_with_the_common_block(requests):
        opens = [tuple(r.prompt_ids[:16]) for r in requests]
        common = max(set(opens), key=opens.count)
        return [o == common for o in opens]

    a, b = (trace_requests(trace, vocab=1000, block_tokens=16, seed=s) for s in (0, 1))
    shared = opens_with_the_common_block(a)
    assert 5 < sum(shared) < 35
    assert opens_with_the_common_block(b) == shared
    assert all(x.prompt_ids != y.prompt_ids for x, y in zip(a, b, strict=True))
    assert [len(x.prompt_ids) for x in a] == [len(y.prompt_ids) for y in b]


def test_bench_replays_a_trace_whose_hash_ids_really_share_prefixes(server, tmp_path):
    import json

    from typer.testing import CliRunner

    from moeinfra.cli.main import app

    rows = [
        {"timestamp": 0, "input_length": 80, "output_length": 6, "hash_ids": [1, 2, 3]},
        {"timestamp": 50, "input_length": 90, "output_length": 5, "hash_ids": [1, 2, 4]},
        {"timestamp": 100, "input_length": 70, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 150, "input_length": 20, "output_length": 3},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "bench"
    result = CliRunner().invoke(
        app,
        ["serve", "bench", "--url", server.url, "--workload", str(trace), "--block-tokens", "32",
         "--out", str(out), "-q"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "bench.json").read_text())["summary"]
    assert (summary["completed"], summary["errors"]) == (4, 0)
    assert summary["output_tokens"] == 6 + 5 + 4 + 3
    assert summary["prompt_tokens"] == 80 + 90 + 70 + 20
    # rows 2 and 3 start with blocks 1, 2 (64 tokens) of row 1: at least 48 of them cached each
    assert summary["cache_hit_rate"] >= 96 / 260
    assert summary["ttft_s"]["p50"] > 0 and summary["tpot_s"]["p50"] > 0
    assert (out / "bench.png").stat().st_size > 0
    bad = CliRunner().invoke(app, ["serve", "bench", "--url", server.url, "--rate", "0", "-q"])
    assert bad.exit_code != 0


def test_bench_holds_at_most_max_concurrency_requests_in_flight(server):
    """Eight requests due at once, at most three sent at a time: never more than three streams
    overlap, each is sent no earlier than it is due, and together they take longer than one wave."""
    import asyncio

    from moeinfra.server.bench import replay, synthetic_requests

    requests = synthetic_requests(8, vocab=1000, output_tokens=(12, 12), seed=5)
    results, _ = asyncio.run(replay(server.url, requests, max_concurrency=3))
    assert all(r.error is None for r in results), [r.error for r in results]
    spans = [(r.sent_s, r.sent_s + r.latency_s) for r in results]
    assert all(r.sent_s >= r.arrival_s for r in results)
    # a stream ends (latency_s) before its slot is free for the next one
    for start, _ in spans:
        overlapping = sum(s <= start < e for s, e in spans)
        assert overlapping <= 3, spans
    assert sum(r.sent_s > min(e for _, e in spans) for r in results) >= 8 - 3


def test_a_request_ending_at_its_first_token_writes_its_prompt_to_disk(server, client, model):
    """lm-eval's loglikelihood requests end at prefill (``max_tokens`` 1) and share long
    contexts: their prompts' blocks reach the on-disk cache as a hand-off's do."""
    before = set(server.cache_dir.rglob("*.kv"))
    prompt = " ".join(f"context sentence number {i} of a shared document" for i in range(12))
    client.completions.create(model=model, prompt=prompt, max_tokens=1)
    # (16-token blocks of a ~100-token prompt, written one after the other by the unit's writer)
    wait_until(lambda: len(set(server.cache_dir.rglob("*.kv")) - before) >= 4, timeout_s=10)
