"""A trace replayed as a server would serve it (issue #39): token and request totals are the
trace's own sums, exactly and as integers; a request longer than the model's context is refused
and counted, the rest served; cache hits never exceed what the trace's block hashes allow."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from moeinfra.serving.prefix_cache import PrefixCache
from moeinfra.serving.workload import read_trace, real_count, real_parts

CONTEXT = 131_072


def mooncake_trace(
    seed: int,
    *,
    block: int,
    conversations: int = 24,
    turns: int = 4,
    system_prompts: int = 0,
    retries: float = 0.15,
    spacing_ms: int = 700,
) -> tuple[list[dict], list[list[int]]]:
    """Multi-turn conversations written out in Mooncake's format (``timestamp`` ms,
    ``input_length``, ``output_length``, ``hash_ids``), from token sequences: each turn's prompt is
    the previous prompt, its answer and a new message; a retry sends a prompt again and the
    conversation goes on with the retry's answer. ``hash_ids`` name each ``block``-token block by
    its content and everything before it (the last, partial one too), as Mooncake's do; with
    ``system_prompts``, conversations open with one of that many shared prompts. Returns the
    rows (in arrival order) and the prompt tokens of each row."""
    rng = random.Random(seed)
    fresh = iter(range(10**9))
    ids: dict[tuple, int] = {}

    def hashes(tokens):
        return [
            ids.setdefault(tuple(tokens[: k + block]), len(ids))
            for k in range(0, len(tokens), block)
        ]

    systems = [[next(fresh) for _ in range(rng.randint(block, 3 * block))] for _ in range(system_prompts)]  # fmt: skip
    events = []
    for c in range(conversations):
        t = c * spacing_ms + rng.randint(0, spacing_ms)
        prompt = list(rng.choice(systems)) if systems else []
        prompt += [next(fresh) for _ in range(rng.randint(1, 4 * block))]
        for _ in range(turns):
            sends = 2 if rng.random() < retries else 1
            for _ in range(sends):
                answer = [next(fresh) for _ in range(rng.randint(1, 3 * block))]
                events.append((t, list(prompt), answer))
                t += rng.randint(1, 3)
            prompt = prompt + answer + [next(fresh) for _ in range(rng.randint(1, 2 * block))]
            t += rng.randint(2_000, 30_000)
    events.sort(key=lambda e: e[0])
    rows = [
        {
            "timestamp": t,
            "input_length": len(p),
            "output_length": len(a),
            "hash_ids": hashes(p),
        }
        for t, p, a in events
    ]
    return rows, [p for _, p, _ in events], [a for _, _, a in events]


def write(path, rows, extra=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra))
    return path


def serve(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_replayed_trace_totals_its_own_sums_exactly_as_integers(tmp_path):
    """Every total of `serve simulate --workload FILE --json` is the trace's own sum, an int:
    requests, input, cache-hit and output tokens (all served: the replay drains), hour by hour
    too; with a fractional --demand-scale each total is rounded once and the parts still add up."""
    rows, _, _ = mooncake_trace(0, block=512, conversations=30)
    trace = write(tmp_path / "t.jsonl", rows)
    workload, _ = read_trace(trace)
    doc = serve("simulate", "--workload", str(trace))
    served = {
        "input_tokens": sum(r["input_length"] for r in rows),
        "output_tokens": sum(r["output_length"] for r in rows),
        "cache_hit_input_tokens": int(workload.cached_tokens.sum()),
    }
    for key, value in served.items():
        assert type(doc[key]) is int and doc[key] == value, key
        assert sum(h[key] for h in doc["hourly"]) == value
    assert doc["requests"] == {
        "arrived": len(rows), "completed": len(rows), "running": 0, "rejected": 0,
        "sampled": len(rows),
    }  # fmt: skip
    assert all(type(v) is int and v == 0 for v in doc["rejected_by_reason"].values())
    scaled = serve("simulate", "--workload", str(trace), "--demand-scale", "1.5")
    for key, value in served.items():
        assert scaled[key] == round(1.5 * value) and type(scaled[key]) is int
        assert sum(h[key] for h in scaled["hourly"]) == scaled[key]
    req = scaled["requests"]
    assert req["arrived"] == round(1.5 * len(rows))
    assert req["arrived"] == req["completed"] + req["running"] + req["rejected"]


def test_integer_parts_add_up_to_the_rounded_total():
    assert real_count(7, 100.0) == 700 and real_count(3, 1.5) == 4  # 4.5 rounds to even
    parts = real_parts([1, 1, 1, 1, 1], 1.5)
    assert parts == [2, 1, 1, 2, 2] and sum(parts) == real_count(5, 1.5) == 8  # 2, 3, 4, 6, 8
    assert real_count(10**12 + 1, 100.0) == 10**14 + 100  # exact, past float64's integers


def test_a_request_over_the_context_is_refused_and_counted_the_rest_served(tmp_path):
    """A live server answers a prompt that, with its answer, exceeds the context with a 400 and
    serves the others: so does the replay (simulate and plan), counting it as arrived and
    rejected for "context"; a malformed line still refuses the trace, naming its line."""
    rows, _, _ = mooncake_trace(1, block=512, conversations=12, turns=2)
    long = {"input_length": 130_000, "output_length": 2_000, "hash_ids": list(range(10**6, 10**6 + 254))}  # fmt: skip
    rows[3:3] = [dict(long, timestamp=rows[2]["timestamp"])]
    rows.append(dict(long, timestamp=rows[-1]["timestamp"] + 5, output_length=1_073))
    trace = write(tmp_path / "t.jsonl", rows)
    fits = [r for r in rows if r["input_length"] + r["output_length"] <= CONTEXT]
    assert len(fits) == len(rows) - 2
    doc = serve("simulate", "--workload", str(trace))
    assert doc["rejected_by_reason"]["context"] == 2
    assert doc["requests"]["arrived"] == len(rows)
    assert doc["requests"]["completed"] == len(fits) and doc["requests"]["rejected"] == 2
    assert doc["input_tokens"] == sum(r["input_length"] for r in fits)
    assert doc["output_tokens"] == sum(r["output_length"] for r in fits)
    plan = serve(
        "plan", "--workload", str(trace), "--modes", "disaggregated", "--prefill-nodes", "4",
        "--decode-nodes", "4", "--micro-batches", "2", "--calibration", "none",
    )  # fmt: skip
    assert plan["requests"] == {"arrived": len(rows), "rejected": 2}
    assert plan["rejected_by_reason"] == {"context": 2}
    bad = write(tmp_path / "bad.jsonl", rows, ['{"timestamp": 1, "input_length": 2.5}\n'])
    done = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", "simulate", "--workload", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"bad.jsonl:{len(rows) + 1}:" in done.stderr and "Traceback" not in done.stderr


def brute_force_bound(rows, block):
    """Check the replay's hits against an unbounded cache keyed by the trace's own block hashes:
    each request's hits are at most ``block`` x its leading hash ids found in earlier requests,
    plus the blocks an earlier request's decode completed after its prompt's full blocks (that
    request's full blocks leading this prompt), each such answer credited at most once. Returns
    (replay hits, unbounded-cache hits, answer blocks' tokens) over the trace."""
    cache, seen, answers = PrefixCache(block), set(), {}
    replay = unbounded = answer_tokens = 0
    for i, r in enumerate(rows):
        n_in, n_out, h = r["input_length"], r["output_length"], r["hash_ids"]
        hits = min(cache.serve(h, n_in, n_out), n_in - 1)
        found = 0
        while found < len(h) and h[found] in seen:
            found += 1
        excess = hits - found * block
        if excess > 0:
            owner = next(
                (
                    j
                    for j, (key, blocks) in answers.items()
                    if len(key) == found and tuple(h[:found]) == key and blocks * block >= excess
                ),
                None,
            )
            assert owner is not None, f"request {i}: {hits} hits, {found} blocks found"
            del answers[owner]
        seen.update(h)
        full = n_in // block
        completed = (n_in + n_out) // block - full
        if completed:
            answers[i] = (tuple(h[:full]), completed)
        replay += hits
        unbounded += min(found * block, n_in - 1)
        answer_tokens += completed * block
    return replay, unbounded, answer_tokens


@pytest.mark.parametrize("seed", range(6))
def test_cache_hits_never_exceed_the_trace_hashes_plus_each_answer_once(seed):
    """Shared system prompts, retries and multi-turn conversations, brute-forced."""
    block = 16
    rows, _, _ = mooncake_trace(seed, block=block, conversations=40, system_prompts=3)
    replay, unbounded, answers = brute_force_bound(rows, block)
    assert unbounded < replay <= unbounded + answers


@pytest.mark.parametrize("seed", range(6))
def test_cache_hits_are_tokens_an_earlier_request_wrote(seed):
    """Conversations that share nothing: every hit is a prefix an earlier prefill or decode
    wrote (the longest common prefix with an earlier prompt or prompt + answer, token by token),
    and the rule finds most of it."""
    block = 16
    rows, prompts, answers = mooncake_trace(seed, block=block, conversations=30)
    cache, written = PrefixCache(block), []
    credited = truth_total = 0
    for r, prompt, answer in zip(rows, prompts, answers, strict=True):
        n_in = r["input_length"]
        hits = min(cache.serve(r["hash_ids"], n_in, r["output_length"]), n_in - 1)
        truth = 0
        for tokens in written:
            common = 0
            while common < min(len(tokens), n_in) and tokens[common] == prompt[common]:
                common += 1
            truth = max(truth, common)
        truth = min(truth, n_in - 1)
        assert hits <= truth
        credited, truth_total = credited + hits, truth_total + truth
        written += [prompt, prompt + answer]
    assert credited >= 0.8 * truth_total


def test_the_replay_credits_the_rule_in_arrival_order(tmp_path):
    """read_trace applies the rule to the requests sorted by arrival, one token kept to compute."""
    rows, _, _ = mooncake_trace(3, block=512, conversations=20, system_prompts=2)
    shuffled = rows[::-1]  # the file's order is not the arrival order
    workload, _ = read_trace(write(tmp_path / "t.jsonl", shuffled))
    cache = PrefixCache(512)
    expected = [
        min(
            cache.serve(r["hash_ids"], r["input_length"], r["output_length"]), r["input_length"] - 1
        )
        for r in rows
    ]
    np.testing.assert_array_equal(workload.cached_tokens, expected)
