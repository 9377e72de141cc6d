"""Workload generator and trace replay."""

import json
import re

import numpy as np
import pytest

from moeinfra.errors import InputError
from moeinfra.serving.prefix_cache import PrefixCache
from moeinfra.serving.workload import (
    DEEPSEEK_DAY_DEMAND,
    LengthModel,
    Workload,
    deepseek_day,
    generate,
    read_trace,
)


def test_demand_curve_matches_the_csv_shape():
    assert len(DEEPSEEK_DAY_DEMAND) == 24
    assert max(DEEPSEEK_DAY_DEMAND) == 1.0 and DEEPSEEK_DAY_DEMAND[10] == 1.0
    assert min(DEEPSEEK_DAY_DEMAND) == pytest.approx(0.2052)


def test_length_model_hits_published_ratios():
    m = LengthModel.from_published()
    assert m.mean_input / m.mean_output == pytest.approx(608 / 168)
    kv = m.mean_input + (m.mean_output * (1 + m.output_cv**2) - 1) / 2
    assert kv == pytest.approx(4_989)
    w = deepseek_day(scale=2_000, seed=3)
    t = w.totals()
    assert t["input_tokens"] / t["output_tokens"] == pytest.approx(608 / 168, rel=0.03)
    assert t["cached_tokens"] / t["input_tokens"] == pytest.approx(0.563, abs=0.01)
    assert np.all(w.cached_tokens < w.input_tokens)
    assert np.all(w.cached_tokens % 64 == 0)


def test_arrivals_follow_the_curve():
    w = generate(requests_per_s_at_peak=50, demand=(1.0, 0.25), seed=1)
    first = np.count_nonzero(w.arrival_s < 3600)
    second = w.size - first
    assert second / first == pytest.approx(0.25, rel=0.05)
    assert np.all(np.diff(w.arrival_s) >= 0)


def test_generate_rejects_bad_input():
    with pytest.raises(InputError, match="requests_per_s_at_peak"):
        generate(requests_per_s_at_peak=0)
    with pytest.raises(InputError, match="hit_ratio"):
        generate(requests_per_s_at_peak=1, hit_ratio=1.0, hours=0.01)


def test_jsonl_mooncake_replay_with_prefix_hits(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 4]},
        {"timestamp": 1000, "input_length": 600, "output_length": 7, "hash_ids": [9, 1]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w, bad = read_trace(path)
    assert bad == 0
    assert w.arrival_s.tolist() == [0.0, 0.5, 1.0]  # Mooncake timestamps are milliseconds
    assert w.cached_tokens.tolist() == [0, 1024, 0]  # two 512-token blocks seen before


def test_follow_up_turn_hits_what_the_previous_decode_wrote(tmp_path):
    # A: 1,200-token prompt (2 full blocks + a partial one) answered with 600 tokens: decode fills
    # block 2 (tokens 1,024..1,535). B repeats A's full blocks and goes on: blocks 0-2 are hits.
    # C shares only A's first block (another chat with the same system prompt): 1 block.
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 3000, "input_length": 900, "output_length": 5, "hash_ids": [1, 30]},
        {"timestamp": 0, "input_length": 1200, "output_length": 600, "hash_ids": [1, 2, 3]},
        {"timestamp": 2000, "input_length": 2100, "output_length": 9, "hash_ids": [1, 2, 10, 11, 12]},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w, _ = read_trace(path)
    assert w.input_tokens.tolist() == [1200, 2100, 900]  # replayed in arrival order
    assert w.cached_tokens.tolist() == [0, 3 * 512, 512]


def test_prefix_cache_stores_prompts_and_outputs():
    cache = PrefixCache(block_tokens=4)
    assert cache.serve([1, 2, 3], input_tokens=10, output_tokens=7) == 0  # writes 2 + 2 full blocks
    assert cache.serve([1, 2, 5, 6, 7], input_tokens=20, output_tokens=1) == 16  # 2 + 2 written
    # blocks 1 and 2 whole, and of block 3 the 2 tokens the first prompt ended with
    assert cache.serve([1, 2, 3], input_tokens=10, output_tokens=1) == 10
    assert cache.serve([9], input_tokens=3, output_tokens=50) == 0  # no full block: no key


def test_prefix_cache_credits_an_answer_once_and_only_to_a_prompt_that_holds_it():
    cache = PrefixCache(block_tokens=4)
    system = 100
    assert cache.serve([system], input_tokens=4, output_tokens=40) == 0  # its answer: 10 blocks
    # later conversations share the system block but are too short to hold that answer
    for conversation in range(1, 40):
        assert cache.serve([system, conversation], input_tokens=8, output_tokens=2) == 4
    # the conversation's next turn holds it: credited once
    turn = [system, *range(200, 215)]
    assert cache.serve(turn, input_tokens=60, output_tokens=2) == 4 * 11
    assert cache.serve([system, *range(300, 315)], input_tokens=60, output_tokens=2) == 4


def test_bad_lines_name_the_line_or_are_counted(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 3}\n'
        "not json\n"
        '{"timestamp": 5, "input_length": 0, "output_length": 3}\n'
        '{"timestamp": 9, "input_length": 7, "output_length": 2}\n'
    )
    with pytest.raises(InputError, match=r"t\.jsonl:2:"):
        read_trace(path)
    w, bad = read_trace(path, skip_bad=True)
    assert bad == 2 and w.size == 2


def test_lengths_ids_and_context_are_checked_per_line(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        '{"timestamp": 0, "input_length": 10, "output_length": 3}',
        '{"timestamp": 1, "input_length": 1.5, "output_length": 3}',  # fractional
        '{"timestamp": 2, "input_length": "12", "output_length": 3}',  # a string
        '{"timestamp": 3, "input_length": 1024, "output_length": 3, "hash_ids": "abc"}',
        '{"timestamp": 4, "input_length": 1024, "output_length": 3, "hash_ids": [1, [2]]}',
        '{"timestamp": 5, "input_length": 131000, "output_length": 100}',  # 131,100 > 131,072
        '{"timestamp": 6, "input_length": 5e9, "output_length": 1}',
        '{"timestamp": 7, "input_length": 1024.0, "output_length": 72, "hash_ids": [1, 2]}',
        '{"timestamp": 8, "input_length": 131000, "output_length": 72}',  # exactly the context
    ]
    path.write_text("\n".join(lines) + "\n")
    for line_no, message in (
        (2, "input_length=1.5 must be a whole number"),
        (3, "input_length='12' must be a whole number"),
        (4, "hash_ids='abc' must be a list of block ids"),
        (5, "hash_ids=[1, [2]] must be a list of block ids"),
    ):
        one = tmp_path / f"line{line_no}.jsonl"
        one.write_text(lines[line_no - 1] + "\n")
        with pytest.raises(InputError, match=rf"line{line_no}\.jsonl:1: .*{re.escape(message)}"):
            read_trace(one)
    w, bad = read_trace(path, skip_bad=True)
    assert bad == 4  # malformed lines only
    assert w.input_tokens.tolist() == [10, 1024, 131000]
    assert w.cached_tokens.tolist() == [0, 0, 0]
    # longer than the context (lines 6 and 7): arrived and refused, as a server answers them
    assert w.refused == {"context": 2}
    assert w.refused_s["context"].tolist() == [0.005, 0.006]
    short, _ = read_trace(path, skip_bad=True, max_context=2048)
    assert short.input_tokens.tolist() == [10, 1024] and short.refused == {"context": 3}
    over = tmp_path / "over.jsonl"
    over.write_text(lines[5] + "\n")
    with pytest.raises(
        InputError, match="holds no request to serve \\(1 exceed the model's context"
    ):
        read_trace(over)


def test_a_line_longer_than_the_limit_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    from moeinfra.serving import workload

    monkeypatch.setattr(workload, "MAX_LINE_BYTES", 100)
    ok = '{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [' + "1," * 10
    path = tmp_path / "t.jsonl"
    assert len(ok + "2]}\n") == 94  # under the limit; then 10,000 bytes without a newline
    path.write_text(ok + "2]}\n" + "x" * 10_000)
    with pytest.raises(InputError, match=r"t\.jsonl:2: line longer than 100 bytes"):
        read_trace(path)
    reads = []
    real_open = type(path).open

    def counting_open(self, *args, **kwargs):
        handle = real_open(self, *args, **kwargs)
        real_readline = handle.readline
        handle.readline = lambda limit=-1: reads.append(limit) or real_readline(limit)
        return handle

    monkeypatch.setattr(type(path), "open", counting_open)
    with pytest.raises(InputError):
        read_trace(path)
    assert reads and all(0 < limit <= 101 for limit in reads)
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("timestamp,input_tokens,output_tokens\n" + "9" * 500)
    with pytest.raises(InputError, match=r"t\.csv:2: line longer than 100 bytes"):
        read_trace(csv_path)


def test_csv_azure_replay(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:51.0,oops,1\n"
    )
    with pytest.raises(InputError, match=r"azure\.csv:4:"):
        read_trace(path)
    w, bad = read_trace(path, skip_bad=True)
    assert bad == 1
    assert w.input_tokens.tolist() == [374, 396]
    assert w.arrival_s[1] == pytest.approx(4.3146, abs=1e-3)
    simple = tmp_path / "s.csv"
    simple.write_text("timestamp,input_tokens,output_tokens\n2.0,10,5\n1.0,20,6\n")
    w, _ = read_trace(simple)
    assert w.input_tokens.tolist() == [20, 10]  # sorted by time
    with pytest.raises(InputError, match="header"):
        bad_header = tmp_path / "h.csv"
        bad_header.write_text("a,b,c\n1,2,3\n")
        read_trace(bad_header)


def test_a_workload_is_20_bytes_a_request_whatever_it_is_built_from():
    """Struct of arrays: float64 arrival, int32 lengths; int64 input is narrowed, a length that
    does not fit int32 is refused by name."""
    w = Workload(
        np.array([0.0, 1.5]), np.array([10, 20]), np.array([3, 4]), np.array([0, 16]), 1.0, 10.0
    )
    assert (w.arrival_s.dtype, w.input_tokens.dtype, w.output_tokens.dtype) == (
        np.float64,
        np.int32,
        np.int32,
    )
    assert w.cached_tokens.tolist() == [0, 16]
    assert (
        sum(a.itemsize for a in (w.arrival_s, w.input_tokens, w.output_tokens, w.cached_tokens))
        == 20
    )
    with pytest.raises(InputError, match=r"Workload.input_tokens must be in \[0, 2,147,483,647\]"):
        Workload(np.array([0.0]), np.array([2**31]), np.array([1]), np.array([0]), 1.0, 1.0)
    day = generate(requests_per_s_at_peak=5.0, hours=0.1)
    assert day.input_tokens.dtype == np.int32 and day.cached_tokens.dtype == np.int32


def test_the_day_generator_draws_lengths_and_hits_as_documented():
    """The generator's rule, replayed by hand from the same random stream: Poisson counts per
    hour, uniform arrivals in the hour, lognormal lengths rounded and clipped to the context, a
    Beta share of the prompt rounded to whole 64-token blocks (leaving >= 1 token)."""
    import math

    lengths = LengthModel(mean_input=2000.0, mean_output=300.0)
    got = generate(
        requests_per_s_at_peak=3.0, demand=(1.0, 0.5), lengths=lengths, seed=7, hit_ratio=0.5
    )
    rng = np.random.default_rng(7)
    counts = rng.poisson(3.0 * np.array([1.0, 0.5]) * 3600.0)
    arrival = np.sort(np.repeat([0.0, 3600.0], counts) + rng.random(counts.sum()) * 3600.0)

    def lognormal(mean, cv, n):
        s2 = math.log1p(cv * cv)
        return rng.lognormal(math.log(mean) - s2 / 2, math.sqrt(s2), n)

    n = counts.sum()
    inputs = np.clip(np.rint(lognormal(2000.0, 1.5, n)), 1, 131_071)
    outputs = np.minimum(np.clip(np.rint(lognormal(300.0, 1.0, n)), 1, None), 131_072 - inputs)
    share = rng.beta(0.5 * 2.0, 0.5 * 2.0, n)
    blocks = np.rint(inputs * share / 64) * 64
    cached = np.minimum(blocks, (inputs - 1) // 64 * 64)
    np.testing.assert_array_equal(got.arrival_s, arrival)
    np.testing.assert_array_equal(got.input_tokens, inputs)
    np.testing.assert_array_equal(got.output_tokens, outputs)
    np.testing.assert_array_equal(got.cached_tokens, cached)
