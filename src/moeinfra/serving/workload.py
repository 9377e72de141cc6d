"""Requests to serve: a generator (24 h arrival curve, length distributions, prefix-cache hits) and
trace replay (Mooncake-style JSONL, Azure-style CSV).

A :class:`Workload` holds sampled requests; each stands for ``scale`` real requests (the sampling rule
of the simulator, see docs/serving-model.md), so token and request totals are ``scale`` x the sums,
kept as integers (:func:`real_count`). Requests refused before they are served (a replayed trace's
prompts longer than the model's context, as a live server answers them with a 400) arrive too:
:attr:`Workload.refused_s`.
"""

from __future__ import annotations

import csv
import json
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from moeinfra.errors import InputError
from moeinfra.serving.prefix_cache import PrefixCache

#: Relative demand per hour from 12:00 UTC+8, digitised from DeepSeek's day-6 income chart
#: (column ``demand_rel_peak`` of deepseek_day6_hourly.csv; peak 1.0 at 22:00).
DEEPSEEK_DAY_DEMAND = (
    0.8706, 0.9187, 0.9815, 0.9963, 0.9815, 0.8965, 0.8632, 0.9519, 0.9889, 0.9926, 1.0, 0.9593,
    0.7006, 0.5786, 0.4233, 0.2569, 0.2052, 0.2052, 0.2569, 0.4418, 0.7449, 0.9483, 0.9815, 0.963,
)  # fmt: skip

#: DeepSeek's published day (REFERENCE.md): tokens in and out, and the cache-hit share of input.
PUBLISHED_INPUT_TOKENS = 608e9
PUBLISHED_OUTPUT_TOKENS = 168e9
PUBLISHED_CACHE_HIT = 342e9 / 608e9
PUBLISHED_KV_PER_OUTPUT_TOKEN = 4_989.0
CACHE_BLOCK_TOKENS = 64
#: DeepSeek-V3's served context (128K tokens): a request's prompt and answer must fit in it.
MAX_CONTEXT_TOKENS = 131_072
#: Largest token count a Workload holds (its lengths are int32).
TOKENS_MAX = np.iinfo(np.int32).max
#: Longest line of a trace file: a request is one short line; longer means not a trace.
MAX_LINE_BYTES = 1 << 20
#: Why a request is refused before it is served (the keys of ``Workload.refused_s``).
REFUSED_REASONS = ("context",)


def real_count(sampled: int | float | np.integer, scale: float) -> int:
    """Real requests or tokens that ``sampled`` ones stand for at ``scale``: an exact integer sum
    times the scale, rounded once (exact when ``scale`` is whole)."""
    if float(scale).is_integer():
        return int(sampled) * int(scale)
    return round(int(sampled) * scale)


def real_parts(sampled: list[int], scale: float) -> list[int]:
    """:func:`real_count` of several parts of one sampled total, rounded so that they add up to
    the real total exactly (each part: the rounded running sum less the one before)."""
    out, before, running = [], 0, 0
    for part in sampled:
        running += int(part)
        now = real_count(running, scale)
        out.append(now - before)
        before = now
    return out


@dataclass(frozen=True)
class Workload:
    """Sampled requests, sorted by arrival, as a struct of arrays (20 bytes per request).

    Attributes:
        arrival_s: ``[n]`` float64 seconds from the start.
        input_tokens: ``[n]`` int32 prompt tokens.
        output_tokens: ``[n]`` int32 generated tokens.
        cached_tokens: ``[n]`` int32 prompt prefix found in the KV cache (``< input_tokens``).
        scale: real requests each sampled request stands for (1 for a replayed trace).
        duration_s: length of the window the workload covers.
        refused_s: requests that arrived but are refused before they are served, by reason
            (:data:`REFUSED_REASONS`): ``{reason: [m] float64 arrival seconds}``, sampled like
            the others (each stands for ``scale``). A replayed trace's prompts that, with their
            answer, exceed the model's context are ``"context"``.
    """

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    cached_tokens: np.ndarray
    scale: float = 1.0
    duration_s: float = 86_400.0
    name: str = "workload"
    refused_s: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arrival_s", np.asarray(self.arrival_s, dtype=np.float64))
        n = self.arrival_s.size
        for field_name in ("input_tokens", "output_tokens", "cached_tokens"):
            values = np.asarray(getattr(self, field_name))
            if values.shape != (n,):
                raise InputError(f"Workload.{field_name} must have shape ({n},)")
            if n and (values.max() > TOKENS_MAX or values.min() < 0):
                raise InputError(f"Workload.{field_name} must be in [0, {TOKENS_MAX:,}]")
            object.__setattr__(self, field_name, values.astype(np.int32, copy=False))
        if n and (np.any(np.diff(self.arrival_s) < 0)):
            raise InputError("Workload.arrival_s must be sorted")
        if n and (self.input_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise InputError("Workload input_tokens and output_tokens must be >= 1")
        if n and np.any(self.cached_tokens >= self.input_tokens):
            raise InputError("Workload.cached_tokens must be < input_tokens")
        if self.scale <= 0 or self.duration_s <= 0:
            raise InputError(
                f"Workload scale={self.scale} and duration_s={self.duration_s} must be > 0"
            )
        unknown = sorted(set(self.refused_s) - set(REFUSED_REASONS))
        if unknown:
            raise InputError(
                f"Workload.refused_s reasons {unknown} are not among {list(REFUSED_REASONS)}"
            )
        refused = {r: np.asarray(t, dtype=np.float64) for r, t in self.refused_s.items()}
        object.__setattr__(self, "refused_s", refused)

    @property
    def size(self) -> int:
        """Requests to serve (sampled; the refused ones are in :attr:`refused`)."""
        return int(self.arrival_s.size)

    @property
    def refused(self) -> dict[str, int]:
        """Sampled requests refused before they are served, by reason (every reason listed)."""
        return {
            r: int(self.refused_s[r].size) if r in self.refused_s else 0 for r in REFUSED_REASONS
        }

    @property
    def output_tokens_per_s(self) -> float:
        """Real-scale output tokens a second over the window: what an API server in front of the
        fleet streams."""
        return self.scale * float(self.output_tokens.sum()) / self.duration_s

    def totals(self) -> dict[str, float | int]:
        """Real-scale requests and tokens to serve (integers: ``scale`` x the sampled sums,
        rounded once), the requests refused before serving, and the mean KV length per output
        token."""
        s = self.scale
        outputs = int(self.output_tokens.sum(dtype=np.int64))
        out = self.output_tokens.astype(np.float64)
        kv = (self.input_tokens * out + out * (out - 1) / 2).sum()
        return {
            "requests": real_count(self.size, s),
            "refused_requests": real_count(sum(self.refused.values()), s),
            "input_tokens": real_count(self.input_tokens.sum(dtype=np.int64), s),
            "cached_tokens": real_count(self.cached_tokens.sum(dtype=np.int64), s),
            "output_tokens": real_count(outputs, s),
            "kv_len_per_output_token": float(kv / max(outputs, 1)),
        }

    def with_demand_scale(self, factor: float) -> Workload:
        """The same arrivals and lengths, each standing for ``factor`` times as many real requests
        (demand x ``factor`` on the same timeline)."""
        if not (math.isfinite(factor) and factor > 0):
            raise InputError(f"demand_scale={factor} must be a finite number > 0")
        return replace(self, scale=self.scale * factor)

    def window(self, start_s: float, end_s: float) -> Workload:
        """Requests arriving in ``[start_s, end_s)``, times shifted to start at 0."""
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s])
        return Workload(
            self.arrival_s[lo:hi] - start_s,
            self.input_tokens[lo:hi],
            self.output_tokens[lo:hi],
            self.cached_tokens[lo:hi],
            self.scale,
            end_s - start_s,
            f"{self.name}[{start_s:g}:{end_s:g}]",
            {r: t[(t >= start_s) & (t < end_s)] - start_s for r, t in self.refused_s.items()},
        )


@dataclass(frozen=True)
class LengthModel:
    """Lognormal prompt and output lengths given by their means and coefficients of variation."""

    mean_input: float
    mean_output: float
    input_cv: float = 1.5
    output_cv: float = 1.0
    max_context: int = 131_072

    @classmethod
    def from_published(
        cls,
        input_output_ratio: float = PUBLISHED_INPUT_TOKENS / PUBLISHED_OUTPUT_TOKENS,
        kv_per_output_token: float = PUBLISHED_KV_PER_OUTPUT_TOKEN,
        input_cv: float = 1.5,
        output_cv: float = 1.0,
    ) -> LengthModel:
        """Means that give the published input:output ratio and mean KV length per output token.

        With independent lengths, the KV length averaged over output tokens is
        ``E[in] + (E[out^2] - E[out]) / (2 E[out]) = r m + (m (1 + cv^2) - 1) / 2`` for output mean m,
        so ``m = (kv + 1/2) / (r + (1 + cv^2) / 2)``.
        """
        if input_output_ratio <= 0 or kv_per_output_token <= 0:
            raise InputError("input_output_ratio and kv_per_output_token must be > 0")
        m = (kv_per_output_token + 0.5) / (input_output_ratio + (1 + output_cv**2) / 2)
        return cls(input_output_ratio * m, m, input_cv, output_cv)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``(input_tokens [n], output_tokens [n])`` int32, each >= 1, sum <= max_context
        (rounded and clipped in place: a day of millions of requests holds one float array at a
        time)."""
        inputs = _lognormal(rng, self.mean_input, self.input_cv, n)
        outputs = _lognormal(rng, self.mean_output, self.output_cv, n)
        np.clip(np.rint(inputs, out=inputs), 1, self.max_context - 1, out=inputs)
        inputs = inputs.astype(np.int32)
        np.clip(np.rint(outputs, out=outputs), 1, None, out=outputs)
        np.minimum(outputs, self.max_context - inputs, out=outputs)
        return inputs, outputs.astype(np.int32)


def _lognormal(rng: np.random.Generator, mean: float, cv: float, n: int) -> np.ndarray:
    sigma2 = math.log1p(cv * cv)
    return rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), n)


def cached_prefix(
    inputs: np.ndarray, hit_ratio: float, rng: np.random.Generator, concentration: float = 2.0
) -> np.ndarray:
    """Cache-hit prefix per prompt: a Beta(mean=hit_ratio) share of it, in whole 64-token blocks
    (rounded, so the expected hit share stays near ``hit_ratio``), always leaving >= 1 token to
    compute."""
    if not 0.0 <= hit_ratio < 1.0:
        raise InputError(f"hit_ratio={hit_ratio} must be in [0, 1)")
    if hit_ratio == 0.0:
        return np.zeros(inputs.size, dtype=np.int32)
    share = rng.beta(hit_ratio * concentration, (1 - hit_ratio) * concentration, inputs.size)
    share *= inputs
    share /= CACHE_BLOCK_TOKENS
    blocks = np.rint(share, out=share).astype(np.int32)
    del share
    blocks *= CACHE_BLOCK_TOKENS
    return np.minimum(blocks, (inputs - 1) // CACHE_BLOCK_TOKENS * CACHE_BLOCK_TOKENS, out=blocks)


def generate(
    *,
    requests_per_s_at_peak: float,
    demand: tuple[float, ...] | np.ndarray = DEEPSEEK_DAY_DEMAND,
    lengths: LengthModel | None = None,
    hit_ratio: float = PUBLISHED_CACHE_HIT,
    hours: float | None = None,
    scale: float = 1.0,
    seed: int = 0,
    name: str = "generated",
) -> Workload:
    """Poisson arrivals with a rate that is piecewise constant per hour (``demand[h]`` x peak rate).

    Each sampled request stands for ``scale`` real ones (arrivals are thinned by ``1/scale``).
    ``hours`` defaults to ``len(demand)``; the curve repeats when longer.
    """
    demand = np.asarray(demand, dtype=np.float64)
    if demand.ndim != 1 or demand.size == 0 or np.any(demand < 0):
        raise InputError("demand must be a non-empty 1-D curve of values >= 0")
    for arg, value in (("requests_per_s_at_peak", requests_per_s_at_peak), ("scale", scale)):
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"{arg}={value} must be a finite number > 0")
    hours = float(demand.size if hours is None else hours)
    if not (math.isfinite(hours) and hours > 0):
        raise InputError(f"hours={hours} must be a finite number > 0")
    rng = np.random.default_rng(seed)
    lengths = lengths or LengthModel.from_published()
    whole = math.ceil(hours)
    starts = np.arange(whole) * 3600.0
    spans = np.minimum(3600.0, hours * 3600.0 - starts)
    counts = rng.poisson(
        requests_per_s_at_peak * demand[np.arange(whole) % demand.size] * spans / scale
    )
    arrival = rng.random(counts.sum())
    arrival *= np.repeat(spans, counts)
    arrival += np.repeat(starts, counts)
    arrival.sort()
    inputs, outputs = lengths.sample(arrival.size, rng)
    cached = cached_prefix(inputs, hit_ratio, rng)
    return Workload(arrival, inputs, outputs, cached, scale, hours * 3600.0, name)


def deepseek_day(
    scale: float = 100.0, seed: int = 0, hours: float | None = None, demand_scale: float = 1.0
) -> Workload:
    """DeepSeek's day: the hourly demand curve with the peak rate at which the curve's expected
    prompt tokens equal the published 608B (the demand is an input; what the fleet serves of it,
    and how fast, is what the simulator finds), times ``demand_scale``."""
    if not (math.isfinite(demand_scale) and demand_scale > 0):
        raise InputError(f"demand_scale={demand_scale} must be a finite number > 0")
    lengths = LengthModel.from_published()
    peak_rate = PUBLISHED_INPUT_TOKENS / (sum(DEEPSEEK_DAY_DEMAND) * 3600.0 * lengths.mean_input)
    return generate(
        requests_per_s_at_peak=peak_rate * demand_scale,
        lengths=lengths,
        hours=hours,
        scale=scale,
        seed=seed,
        name="deepseek-v3-day",
    )


def constant_demand(
    output_tokens_per_s: float,
    hours: float = 1.0,
    scale: float = 1.0,
    seed: int = 0,
    lengths: LengthModel | None = None,
) -> Workload:
    """A steady demand of ``output_tokens_per_s`` (Poisson arrivals) for ``hours``, with
    ``lengths`` (default DeepSeek's published prompt and answer length distributions) and the
    published cache-hit share."""
    if not (math.isfinite(output_tokens_per_s) and output_tokens_per_s > 0):
        raise InputError(f"output_tokens_per_s={output_tokens_per_s} must be a finite number > 0")
    lengths = lengths or LengthModel.from_published()
    return generate(
        requests_per_s_at_peak=output_tokens_per_s / lengths.mean_output,
        demand=(1.0,),
        lengths=lengths,
        hours=hours,
        scale=scale,
        seed=seed,
        name=f"{output_tokens_per_s:g} output tokens/s",
    )


# ---- trace replay ------------------------------------------------------------------------------


def _parse_time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text.strip()[:26]).timestamp()


def _lines(handle, path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a binary file, never holding more than :data:`MAX_LINE_BYTES`
    of one line."""
    line_no = 0
    while line := handle.readline(MAX_LINE_BYTES + 1):
        line_no += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise InputError(
                f"{path}:{line_no}: line longer than {MAX_LINE_BYTES:,} bytes; a trace has one "
                "request per line"
            )
        try:
            yield line_no, line.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{path}:{line_no}: not UTF-8 text") from None


def _whole_number(value: object, name: str) -> int:
    """A JSON length: an integer (or a float with no fraction), never a bool or a string."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}={value!r} must be a whole number")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name}={value!r} must be a whole number")
    return int(value)


def _block_ids(value: object) -> list:
    if not isinstance(value, list) or not all(
        isinstance(h, int | str) and not isinstance(h, bool) for h in value
    ):
        raise ValueError(
            f"hash_ids={value!r:.60} must be a list of block ids (integers or strings)"
        )
    return value


def read_trace(
    path: str | Path,
    *,
    skip_bad: bool = False,
    time_unit_s: float | None = None,
    hash_block_tokens: int = 512,
    hit_ratio: float = 0.0,
    seed: int = 0,
    max_context: int = MAX_CONTEXT_TOKENS,
) -> tuple[Workload, int]:
    """Read a request trace; return ``(workload, bad_lines_skipped)``.

    * ``.jsonl``: one object per line with ``timestamp``, ``input_length``, ``output_length`` and
      optional ``hash_ids`` (prefix blocks of ``hash_block_tokens`` tokens, as in Mooncake traces;
      a block written earlier, by a prefill or by the decode of the turn a prompt follows, is a
      cache hit: :class:`~moeinfra.serving.prefix_cache.PrefixCache`, in arrival order).
      Timestamps in ms unless ``time_unit_s`` is given.
    * ``.csv``: header ``timestamp,input_tokens,output_tokens`` (or Azure's
      ``TIMESTAMP,ContextTokens,GeneratedTokens``); timestamps in seconds or ISO date-times.

    Without ``hash_ids`` the cache-hit prefix follows the ``hit_ratio`` model. A request whose
    prompt and answer exceed ``max_context`` tokens (the model's context) arrives and is refused,
    as a live server answers it with a 400: it is kept in ``Workload.refused_s["context"]`` (its
    arrival time), not served, and writes nothing to the prefix cache. Malformed lines raise
    InputError naming the line number, or are skipped and counted with ``skip_bad``: not a JSON
    request object (or CSV row), lengths that are not whole numbers >= 1, ``hash_ids`` that are not
    a list of ids, a timestamp that is not a finite number. The file is read line by line; a line
    longer than :data:`MAX_LINE_BYTES` is an error (the file is not a trace).
    """
    path = Path(path)
    # growing C arrays, 16 bytes a request (not a Python tuple each)
    times, ins, outs = array("d"), array("i"), array("i")
    over_context = array("d")  # arrival times of the requests refused for the context
    bad = 0
    has_hashes = False
    blocks: dict[int, list] = {}  # row -> its prompt's hash_ids

    def fail(line_no: int, why: str) -> None:
        nonlocal bad
        if not skip_bad:
            raise InputError(f"{path}:{line_no}: {why}")
        bad += 1

    def lengths_fit(line_no: int, t: float, n_in: int, n_out: int, names: tuple[str, str]) -> bool:
        """Whether the request is served: malformed lengths fail, one over the context is
        refused (kept, with its arrival time)."""
        if n_in < 1 or n_out < 1:
            fail(line_no, f"{names[0]}={n_in} and {names[1]}={n_out} must be >= 1")
            return False
        if n_in + n_out > max_context:
            over_context.append(t)
            return False
        return True

    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        unit = 1e-3 if time_unit_s is None else time_unit_s
        with path.open("rb") as handle:
            for line_no, line in _lines(handle, path):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    t = float(obj["timestamp"]) * unit
                    n_in = _whole_number(obj["input_length"], "input_length")
                    n_out = _whole_number(obj["output_length"], "output_length")
                    hashes = obj.get("hash_ids")
                    if hashes is not None:
                        hashes = _block_ids(hashes)
                except (ValueError, KeyError, TypeError) as exc:
                    fail(line_no, f"not a request object ({type(exc).__name__}: {exc})")
                    continue
                if not math.isfinite(t):
                    fail(line_no, f"timestamp={obj['timestamp']!r} must be a finite number")
                    continue
                if not lengths_fit(line_no, t, n_in, n_out, ("input_length", "output_length")):
                    continue
                if hashes is not None:
                    has_hashes = True
                    blocks[len(times)] = hashes
                times.append(t)
                ins.append(n_in)
                outs.append(n_out)
    elif suffix == ".csv":
        unit = 1.0 if time_unit_s is None else time_unit_s
        with path.open("rb") as handle:
            reader = csv.reader(text for _, text in _lines(handle, path))
            header = [h.strip().lower() for h in next(reader, [])]
            names = {
                "timestamp": ("timestamp",),
                "in": ("input_tokens", "contexttokens"),
                "out": ("output_tokens", "generatedtokens"),
            }
            try:
                cols = {
                    k: next(header.index(c) for c in v if c in header) for k, v in names.items()
                }
            except StopIteration:
                raise InputError(
                    f"{path}:1: header {header} must name timestamp,input_tokens,output_tokens"
                ) from None
            for line_no, row in enumerate(reader, 2):
                if not row:
                    continue
                try:
                    t = _parse_time(row[cols["timestamp"]]) * unit
                    n_in, n_out = int(row[cols["in"]]), int(row[cols["out"]])
                except (ValueError, IndexError) as exc:
                    fail(line_no, f"bad row {row!r} ({exc})")
                    continue
                if not math.isfinite(t):
                    fail(line_no, f"timestamp={row[cols['timestamp']]!r} must be a finite number")
                    continue
                if not lengths_fit(line_no, t, n_in, n_out, ("input_tokens", "output_tokens")):
                    continue
                times.append(t)
                ins.append(n_in)
                outs.append(n_out)
    else:
        raise InputError(f"trace {str(path)!r} must end in .jsonl or .csv")
    if not times:
        why = (
            f" ({len(over_context):,} exceed the model's context of {max_context:,} tokens)"
            if over_context
            else ""
        )
        raise InputError(f"trace {str(path)!r} holds no request to serve{why}")
    order = np.argsort(np.frombuffer(times, dtype=np.float64), kind="stable")
    arrival = np.frombuffer(times, dtype=np.float64)[order]
    inputs = np.frombuffer(ins, dtype=np.int32)[order]
    outputs = np.frombuffer(outs, dtype=np.int32)[order]
    cached = np.zeros(inputs.size, dtype=np.int32)
    if has_hashes:
        cache = PrefixCache(hash_block_tokens)
        for i, row in enumerate(order.tolist()):
            if row in blocks:
                n_in, n_out = int(inputs[i]), int(outputs[i])
                cached[i] = min(cache.serve(blocks[row], n_in, n_out), n_in - 1)
    refused = np.sort(np.frombuffer(over_context, dtype=np.float64))
    start = min(arrival[0], refused[0]) if refused.size else arrival[0]
    arrival -= start
    refused -= start
    if not has_hashes and hit_ratio > 0:
        cached = cached_prefix(inputs, hit_ratio, np.random.default_rng(seed))
    duration = float(max(arrival[-1], refused[-1] if refused.size else 0.0)) + 1.0
    return (
        Workload(arrival, inputs, outputs, cached, 1.0, duration, path.stem, {"context": refused}),
        bad,
    )
