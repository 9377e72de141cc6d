"""The prefill units' whole-step queues: hand-checked steps, M/M/c where a step holds one prompt,
and a sampled run against the exact one."""

import math

import numpy as np
import pytest

from moeinfra.serving.prefill_queue import PrefillQueue


def queue(arrival, work, tokens, *, units=1, step_s=0.0, budget=1000.0, ranks=1, scale=1.0, **kw):
    """A queue whose step takes at least ``step_s`` whatever it holds."""
    return PrefillQueue(
        np.asarray(arrival, float),
        np.asarray(work, float) * scale,
        np.asarray(tokens, float),
        step_tokens=np.array([1.0, budget]),
        step_rank_s=np.array([step_s, step_s]),
        ranks=ranks,
        rank_budget=budget,
        scale=scale,
        max_units=units,
        **kw,
    )


def test_a_prompt_arriving_mid_step_waits_for_the_step_and_shares_the_next():
    # steps take 50 ms at least; A starts at once, B waits for A's step, C and D share one step
    q = queue([0.0, 0.02, 0.06, 0.07], [0.01, 0.01, 0.03, 0.04], [100] * 4, step_s=0.05)
    idx, unit, first, refused, spans = q.admit(0, 4, 1, last=True)
    assert refused.size == 0 and list(idx) == [0, 1, 2, 3] and set(unit) == {0}
    np.testing.assert_allclose(first, [0.05, 0.10, 0.17, 0.17])  # C + D: 70 ms of work > 50
    np.testing.assert_allclose(spans, [[0, 0.0, 0.05], [0, 0.05, 0.10], [0, 0.10, 0.17]])


def test_a_prompt_over_the_budget_is_continued_in_the_next_steps():
    # 2,500 tokens in steps of 1,000 (two ranks of 500): three steps; the request overhead is added
    q = queue([0.0], [0.3], [2500], step_s=0.05, budget=500, ranks=2, request_overhead_s=0.01)
    idx, _, first, _, spans = q.admit(0, 1, 1, last=True)
    np.testing.assert_allclose(spans[:, 2] - spans[:, 1], [0.12, 0.12, 0.06])
    assert first[0] == pytest.approx(0.30 + 0.01)


def test_every_step_time_is_drawn_from_the_jitter_quantiles():
    # a constant jitter of 2: the first test's prompts, its steps twice as long (so B, C and D
    # all arrive during A's step and share the next: 80 ms of work, x 2)
    q = queue(
        [0.0, 0.02, 0.06, 0.07], [0.01, 0.01, 0.03, 0.04], [100] * 4, step_s=0.05,
        step_jitter=[2.0, 2.0],
    )  # fmt: skip
    _, _, first, _, _ = q.admit(0, 4, 1, last=True)
    np.testing.assert_allclose(first, [0.10, 0.26, 0.26, 0.26])
    # quantiles 0.5 / 1 / 2 at probabilities 0 / 0.5 / 1: a step is as likely shorter as longer
    n = 4000
    q = queue(np.arange(n) * 1.0, np.zeros(n), np.full(n, 100.0), step_s=0.05,
              step_jitter=[0.5, 1.0, 2.0])  # fmt: skip
    _, _, _, _, spans = q.admit(0, n, 1, last=True)
    ratio = (spans[:, 2] - spans[:, 1]) / 0.05
    assert ratio.min() >= 0.5 and ratio.max() <= 2.0
    assert np.median(ratio) == pytest.approx(1.0, abs=0.03)
    assert np.mean(ratio) == pytest.approx((0.75 + 1.5) / 2, abs=0.03)


@pytest.mark.parametrize("jitter", [(), (0.5, 1.0, 2.0)])
def test_steps_start_only_when_their_prompts_are_known(jitter):
    """Fed a tick at a time, the queue forms the same steps as fed at once."""
    rng = np.random.default_rng(3)
    n = 400
    arrival = np.sort(rng.random(n) * 20)
    work, tokens = rng.random(n) * 0.1, rng.integers(50, 900, n)
    whole = queue(arrival, work, tokens, units=3, step_s=0.04, step_jitter=jitter).admit(
        0, n, 3, last=True
    )
    q = queue(arrival, work, tokens, units=3, step_s=0.04, step_jitter=jitter)
    parts, lo = [], 0
    for t1 in np.arange(0.25, 20.5, 0.25):
        hi = int(np.searchsorted(arrival, t1))
        parts.append(q.admit(lo, hi, 3, until=t1))
        lo = hi
    parts.append(q.admit(n, n, 3, last=True))
    idx = np.concatenate([p[0] for p in parts])
    first = np.concatenate([p[2] for p in parts])
    order = np.argsort(idx)
    assert q.pending == 0
    np.testing.assert_array_equal(idx[order], whole[0])
    np.testing.assert_allclose(first[order], whole[2])
    np.testing.assert_allclose(np.concatenate([p[4] for p in parts]), whole[4])


def test_one_prompt_per_step_is_the_m_m_c_queue():
    """Poisson arrivals, exponential work, 4 units at 80%, a step holding one prompt: the mean
    wait is Erlang C's."""
    rng = np.random.default_rng(1)
    c, rate, n = 4, 3.2, 400_000
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    work = rng.exponential(1.0, n)
    q = queue(arrival, work, np.full(n, 1000.0), units=c)
    idx, _, first, refused, _ = q.admit(0, n, c, last=True)
    assert refused.size == 0 and idx.size == n
    wait = first - arrival - work
    a = rate  # offered load in units (mean work 1 s)
    terms = [a**k / math.factorial(k) for k in range(c)]
    last = a**c / math.factorial(c) * c / (c - a)
    erlang_c = last / (sum(terms) + last)
    assert wait.mean() == pytest.approx(erlang_c / (c - a), rel=0.05)
    assert (wait > 1e-6).mean() == pytest.approx(erlang_c, rel=0.03)


def test_a_request_expected_to_wait_too_long_is_refused():
    q = queue([0.0, 0.1, 0.2], [5.0, 5.0, 5.0], [100] * 3, max_wait_s=6.0)
    idx, _, first, refused, _ = q.admit(0, 3, 1, last=True)
    assert list(refused) == [2] and list(idx) == [0, 1]
    np.testing.assert_allclose(first, [5.0, 10.0])


@pytest.mark.parametrize(("load", "band"), [(0.3, 0.05), (0.8, 0.35)])
def test_a_sampled_queue_waits_as_the_exact_one(load, band):
    """The same Poisson traffic, every request (scale 1) or one in 20 standing for 20: the TTFT
    median and 95th percentile agree within ``band`` (measured, seeds 7-9: within 1% at 30%
    busy; at 80%, p50 -7% and p95 +23 to +30%: the unseen prompts go to the units at random,
    where each real prompt goes to the unit with the least work)."""
    rng = np.random.default_rng(7)
    units, n, step_s, work_per_token = 4, 200_000, 0.03, 1e-4
    tokens = rng.integers(100, 4000, n).astype(float)
    work = tokens * work_per_token
    mean_step = step_s + (work.mean())  # a step holding one prompt, roughly
    rate = load * units / max(mean_step, work.mean())
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    exact = queue(arrival, work, tokens, units=units, step_s=step_s, budget=8192)
    idx, _, first, _, _ = exact.admit(0, n, units, last=True)
    ttft_exact = first - arrival[idx]
    keep = np.sort(rng.choice(n, n // 20, replace=False))
    sampled = queue(
        arrival[keep], work[keep], tokens[keep], units=units, step_s=step_s, budget=8192, scale=20
    )
    idx, _, first, _, _ = sampled.admit(0, keep.size, units, last=True)
    ttft_sampled = first - arrival[keep][idx]
    for q in (0.5, 0.95):
        assert np.quantile(ttft_sampled, q) == pytest.approx(np.quantile(ttft_exact, q), rel=band)
