"""Sampling parameters, the batched sampler's distributions and reproducibility, stop strings."""

import itertools
import math
import pickle
from dataclasses import replace

import pytest
import torch

from moeinfra.engine.sampling import SamplingParams, StopChecker, request_generator, sample
from moeinfra.errors import InputError

# Pearson's statistic over 3 outcomes has 2 degrees of freedom; chi-square(2) is Exp(mean 2), so
# P(X > x) = exp(-x / 2) and the critical value at significance 1e-3 is -2 ln(1e-3) = 13.8.
CHI2_DF2_CRITICAL = -2 * math.log(1e-3)


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """``n`` tokens for ``logits`` [V], each from its own request seeded 0..n-1: [n] int64."""
    ps = [replace(params, seed=s) for s in range(n)]
    return sample(logits.expand(n, -1), ps, [request_generator(p.seed) for p in ps], [0] * n)


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of ``tokens`` against the distribution ``probs`` [V] (zeros skipped)."""
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    return float(((observed - expected)[keep] ** 2 / expected[keep]).sum())


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "parts"),
    [
        ({"temperature": -0.1}, ["temperature=-0.1", ">= 0"]),
        ({"temperature": math.nan}, ["temperature=nan", ">= 0"]),
        ({"temperature": "hot"}, ["temperature='hot'", "number"]),
        ({"top_p": 1.5}, ["top_p=1.5", "(0, 1]"]),
        ({"top_p": 0.0}, ["top_p=0.0", "(0, 1]"]),
        ({"top_k": -2}, ["top_k=-2", "-1 or 0 (off) or >= 1"]),
        ({"top_k": 2.0}, ["top_k=2.0", "an int"]),
        ({"max_tokens": 0}, ["max_tokens=0", "None or an int >= 1"]),
        ({"stop": [""]}, ["stop=['']", "non-empty str"]),
        ({"stop": 5}, ["stop=5", "non-empty str"]),
        ({"stop_token_ids": [2, -1]}, ["stop_token_ids=[2, -1]", "ints >= 0"]),
        ({"seed": -1}, ["seed=-1", "[0, 2**64)"]),
        ({"seed": 1.5}, ["seed=1.5", "an int"]),
        ({"ignore_eos": "yes"}, ["ignore_eos='yes'", "bool"]),
        ({"min_tokens": -1}, ["min_tokens=-1", ">= 0"]),
        ({"min_tokens": 20, "max_tokens": 16}, ["min_tokens=20", "<= max_tokens=16"]),
        ({"include_stop_str_in_output": 1}, ["include_stop_str_in_output=1", "bool"]),
    ],
)
def test_bad_params_name_argument_value_and_allowed(kwargs, parts):
    with pytest.raises(InputError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert all(part in message for part in parts), message


def test_params_normalised_hashable_picklable():
    p = SamplingParams(stop="###", stop_token_ids=[7, 9], seed=3, max_tokens=None, min_tokens=4)
    assert p.stop == ("###",) and p.stop_token_ids == (7, 9)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().stop == () and SamplingParams().stop_token_ids == ()
    assert pickle.loads(pickle.dumps(p)) == p and hash(pickle.loads(pickle.dumps(p))) == hash(p)
    same = SamplingParams(
        stop=("###",), stop_token_ids=(7, 9), seed=3, max_tokens=None, min_tokens=4
    )
    assert p == same and hash(p) == hash(same)
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not any(SamplingParams(top_k=k).greedy for k in (-1, 0, 2))


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_lowest_index_ties_and_draws_nothing():
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    logits[1, [4, 9, 20]] = 50.0  # tie: token 4 must win
    logits[3] = 0.0  # all tied: token 0
    params = [SamplingParams(temperature=0.0, seed=s) for s in range(5)]
    generators = [request_generator(p.seed) for p in params]
    seeded_states = [g.get_state() for g in generators]
    global_state = torch.get_rng_state()
    tokens = sample(logits, params, generators, [0] * 5)
    assert tokens.dtype == torch.int64 and tokens.tolist() == logits.argmax(-1).tolist()
    assert tokens[1] == 4 and tokens[3] == 0
    assert torch.equal(torch.get_rng_state(), global_state)
    assert all(
        torch.equal(g.get_state(), s) for g, s in zip(generators, seeded_states, strict=True)
    )


def test_top_k_1_is_greedy_inside_a_mixed_batch():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    logits[2, [5, 11]] = 9.0
    params = [
        SamplingParams(top_k=1, temperature=1.5),
        SamplingParams(temperature=0.7, seed=4),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.0),
    ]
    tokens = sample(logits, params, [request_generator(p.seed) for p in params], [0] * 4)
    assert tokens[[0, 2, 3]].tolist() == logits[[0, 2, 3]].argmax(-1).tolist()
    assert tokens[2] == 5


# --------------------------------------------------------------------------- distributions


PROBS = torch.tensor([0.02, 0.25, 0.08, 0.30, 0.10, 0.04, 0.15, 0.06])  # V = 8, shuffled order


def test_top_k_draws_only_top_k_at_renormalised_frequencies():
    tokens = _draw(PROBS.log(), SamplingParams(top_k=3), 2000)
    assert set(tokens.tolist()) == {1, 3, 6}  # the three most probable
    top3 = torch.zeros(8).index_fill(0, torch.tensor([1, 3, 6]), 1.0) * PROBS
    assert _chi2(tokens, top3 / top3.sum()) < CHI2_DF2_CRITICAL


def test_top_k_frequencies_from_the_global_rng():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        n = 2000
        tokens = sample(
            PROBS.log().expand(n, -1), [SamplingParams(top_k=3)] * n, [None] * n, [0] * n
        )
    top3 = torch.zeros(8).index_fill(0, torch.tensor([1, 3, 6]), 1.0) * PROBS
    assert set(tokens.tolist()) == {1, 3, 6}
    assert _chi2(tokens, top3 / top3.sum()) < CHI2_DF2_CRITICAL


@pytest.mark.parametrize(
    ("top_p", "nucleus"),
    [
        # sorted probabilities 0.30 (3), 0.25 (1), 0.15 (6), 0.10 (4), 0.08 (2), ...;
        # mass before each: 0, 0.30, 0.55, 0.70, 0.80, ... A token stays while it is < top_p.
        (0.2, {3}),
        (0.5, {3, 1}),
        (0.6, {3, 1, 6}),
        (0.75, {3, 1, 6, 4}),
    ],
)
def test_top_p_keeps_exactly_the_nucleus(top_p, nucleus):
    assert set(_draw(PROBS.log(), SamplingParams(top_p=top_p), 1000).tolist()) == nucleus


def test_top_k_then_top_p():
    # top_k=3 renormalises to 0.4286, 0.3571, 0.2143; mass before: 0, 0.43, 0.79
    assert set(_draw(PROBS.log(), SamplingParams(top_k=3, top_p=0.7), 1000).tolist()) == {3, 1}


def test_min_p_keeps_tokens_within_its_share_of_the_top_one_after_temperature():
    # at temperature 0.5 the probabilities are PROBS**2 renormalised: 0.30 -> 0.457, 0.25 ->
    # 0.317, 0.15 -> 0.114, 0.10 -> 0.051; min_p 0.2 keeps what is >= 0.091 (tokens 3, 1, 6)
    params = SamplingParams(temperature=0.5, min_p=0.2)
    tokens = _draw(PROBS.log(), params, 2000)
    assert set(tokens.tolist()) == {3, 1, 6}
    kept = torch.zeros(8).index_fill(0, torch.tensor([1, 3, 6]), 1.0) * PROBS**2
    assert _chi2(tokens, kept / kept.sum()) < CHI2_DF2_CRITICAL
    assert set(_draw(PROBS.log(), SamplingParams(min_p=1.0), 200).tolist()) == {3}


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_frequencies_match_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([0.6, 0.3, 0.1]).log()
    tokens = _draw(logits, SamplingParams(temperature=temperature), 2000)
    assert _chi2(tokens, (logits / temperature).softmax(-1)) < CHI2_DF2_CRITICAL


# --------------------------------------------------------------------------- reproducibility


STEPS = 20
VOCAB = 64


def _logits(request: int, step: int) -> torch.Tensor:
    """A fixed [VOCAB] logits row for (request, step)."""
    return 2 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 * request + step))


def _run(batch: list[tuple[int, SamplingParams]]) -> list[list[int]]:
    """Tokens of each (request id, params) in ``batch`` over STEPS steps, sampled together."""
    generators = [request_generator(p.seed) for _, p in batch]
    out: list[list[int]] = [[] for _ in batch]
    for step in range(STEPS):
        logits = torch.stack([_logits(r, step) for r, _ in batch])
        tokens = sample(logits, [p for _, p in batch], generators, [step] * len(batch))
        for seq, t in zip(out, tokens.tolist(), strict=True):
            seq.append(t)
    return out


@pytest.mark.parametrize(
    "params",
    [SamplingParams(seed=7, temperature=0.8, top_k=20, top_p=0.9), SamplingParams(seed=7)],
    ids=["filtered", "unfiltered"],
)
def test_seeded_request_same_alone_and_at_another_row_of_a_mixed_batch(params):
    alone = _run([(0, params)])[0]
    others = [
        (1, SamplingParams(temperature=1.3)),
        (2, SamplingParams(seed=8, top_p=0.5)),
        (3, SamplingParams(temperature=0.0)),
        (4, SamplingParams(seed=9, top_k=5)),
    ]
    with torch.random.fork_rng():
        assert _run([*others[:2], (0, params), *others[2:]])[2] == alone
        assert _run([*others[::-1], (0, params)])[4] == alone
    assert len(set(alone)) > 5  # really sampled, not stuck on one token


def test_different_seeds_give_different_tokens():
    a, b = _run([(0, SamplingParams(seed=1)), (0, SamplingParams(seed=2))])
    assert a != b


def test_bad_sample_arguments():
    logits = torch.zeros(2, 4)
    with pytest.raises(InputError, match=r"generators\[1\]=None .* params\[1\].seed=3"):
        sample(logits, [SamplingParams(), SamplingParams(seed=3)], [None, None], [0, 0])
    with pytest.raises(InputError, match=r"len\(steps\)=1 .* logits.shape\[0\]=2"):
        sample(logits, [SamplingParams()] * 2, [None] * 2, [0])
    with pytest.raises(InputError, match=r"logits.shape=\(4,\)"):
        sample(logits[0], [SamplingParams()], [None], [0])


# --------------------------------------------------------------------------- stop strings


def _stream(checker: StopChecker, chunks: list[str]) -> list[tuple[str, bool]]:
    """check() of each cumulative text, up to and including the first that stops."""
    results, text = [], ""
    for chunk in chunks:
        text += chunk
        results.append(checker.check(text))
        if results[-1][1]:
            break
    return results


def test_stop_in_the_middle_truncates_or_keeps_it():
    assert StopChecker(("END",), False).check("abcENDdef") == ("abc", True)
    assert StopChecker(("END",), True).check("abcENDdef") == ("abcEND", True)
    assert StopChecker((), False).check("abcEN") == ("abcEN", False)


def test_partial_prefix_is_withheld_until_it_breaks():
    checker = StopChecker(("END", "STOP"), False)
    assert checker.check("abcEN") == ("abc", False)
    assert checker.check("abcENx") == ("abcENx", False)
    assert checker.check("abcST") == ("abc", False)
    # with include_stop_str_in_output the stop string is shown anyway: nothing to withhold
    assert StopChecker(("END",), True).check("abcEN") == ("abcEN", False)


def test_stop_spanning_chunks_is_never_partly_exposed():
    checker = StopChecker(("<END>",), False)
    results = _stream(checker, ["Hello <", "EN", "D> and more"])
    assert results == [("Hello ", False), ("Hello ", False), ("Hello ", True)]
    results = _stream(StopChecker(("<END>",), True), ["Hello <", "EN", "D> and more"])
    assert results == [("Hello <", False), ("Hello <EN", False), ("Hello <END>", True)]


def test_earliest_stop_wins():
    assert StopChecker(("world", "lo"), False).check("hello world") == ("hel", True)
    # "bc" completes before "abcd", whatever the chunks: one-shot agrees with char by char
    checker = StopChecker(("abcd", "bc"), False)
    assert checker.check("xabcd") == ("xa", True)
    assert _stream(checker, list("xabcd"))[-1] == ("xa", True)
    # equal ends: the longer (earlier) one
    assert StopChecker(("bc", "abc"), True).check("xabcy") == ("xabc", True)


@pytest.mark.parametrize("include", [False, True])
def test_stream_exposures_grow_and_match_one_shot(include):
    checker = StopChecker(("aab", "ba", "bbb"), include)
    texts = ["abababbbaa", "aaaabbbb", "bbabaab", "aaaaaaa", "abbabbab"]
    for text in texts:
        results = _stream(checker, list(text))
        exposed = [r[0] for r in results]
        assert all(b.startswith(a) for a, b in itertools.pairwise(exposed))
        assert results[-1] == checker.check(text)


def test_empty_stop_string_rejected():
    with pytest.raises(InputError, match=r"stop=\('a', ''\)"):
        StopChecker(("a", ""), False)
