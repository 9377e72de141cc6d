"""``moeinfra serve bench``: replay a workload against a live server and measure what users see.

Requests come from the project's trace format (Mooncake-style JSONL: ``timestamp`` ms,
``input_length``, ``output_length``, optional ``hash_ids``) or a synthetic mix. ``hash_ids`` become
real token prefixes: block ``h`` is always the same ``block_tokens`` token ids, so two requests that
share hash ids share the prompt prefix the server's caches can reuse. Each request is a streamed
``/v1/completions`` call with token-id prompts, ``ignore_eos`` (so it generates exactly its output
length) and ``stream_options.include_usage`` (for cached tokens). Arrivals follow the trace's
timestamps, or a Poisson process at ``rate`` requests/s.

Per request: TTFT, every inter-token gap, TPOT, tokens, cached tokens, error. The summary has
percentiles, throughput, cache hit rate and error count, as JSON, and a figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeinfra.atomicio import atomic_path, write_text_atomic
from moeinfra.errors import InputError


@dataclass
class BenchRequest:
    arrival_s: float
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class BenchResult:
    """What one request measured (seconds; ``error`` None when it succeeded)."""

    arrival_s: float
    prompt_tokens: int
    sent_s: float | None = None  # from the replay's start; later than arrival_s while capped
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2 or self.ttft_s is None or self.latency_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def token_block(block_id: int, block_tokens: int, vocab: int, seed: int = 0) -> list[int]:
    """The token ids of block ``block_id`` (the same ids for the same block and ``seed``)."""
    rng = np.random.default_rng([int(block_id) & 0xFFFFFFFF, 0x6D6F65, seed])
    return rng.integers(1, vocab, block_tokens).tolist()


def trace_requests(
    path: str | Path,
    *,
    vocab: int,
    block_tokens: int = 512,
    limit: int | None = None,
    time_scale: float = 1.0,
    max_model_len: int | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """Requests of a Mooncake-style JSONL trace, arrival times from 0, ``time_scale`` x slower.

    Prompts are the blocks of their ``hash_ids`` (cut to ``input_length``; lines without
    ``hash_ids`` get a prompt of their own), the blocks' tokens drawn with ``seed`` (replaying a
    trace twice on one server with the same seed finds the first replay's prompts in its prefix
    caches). Requests longer than ``max_model_len`` are refused with the line number."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        raise InputError(f"--workload={str(path)!r} must be a .jsonl trace or 'synthetic'")
    out: list[BenchRequest] = []
    first = None
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                t = float(obj["timestamp"]) / 1e3
                n_in, n_out = obj["input_length"], obj["output_length"]
                hashes = obj.get("hash_ids") or []
            except (ValueError, KeyError, TypeError) as err:
                raise InputError(f"{path}:{line_no}: not a request object ({err})") from None
            if not all(isinstance(x, int) and x >= 1 for x in (n_in, n_out)):
                raise InputError(
                    f"{path}:{line_no}: input_length={n_in!r} and output_length={n_out!r} "
                    "must be whole numbers >= 1"
                )
            if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
                raise InputError(f"{path}:{line_no}: hash_ids={hashes!r} must be a list of ints")
            if max_model_len is not None and n_in + n_out > max_model_len:
                raise InputError(
                    f"{path}:{line_no}: input_length + output_length = {n_in + n_out} exceeds "
                    f"the server's max_model_len={max_model_len}"
                )
            first = t if first is None else first
            ids: list[int] = []
            for h in hashes:
                ids += token_block(h, block_tokens, vocab, seed)
            if len(ids) < n_in:  # a prompt's own tail
                ids += token_block(-line_no - 1, n_in - len(ids), vocab, seed)
            out.append(BenchRequest((t - first) * time_scale, ids[:n_in], n_out))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise InputError(f"--workload={str(path)!r} holds no request")
    out.sort(key=lambda r: r.arrival_s)
    return out


def synthetic_requests(
    num_requests: int,
    *,
    vocab: int,
    input_tokens: tuple[int, int] = (32, 256),
    output_tokens: tuple[int, int] = (16, 64),
    shared_prefix_tokens: int = 64,
    shared_fraction: float = 0.5,
    seed: int = 0,
) -> list[BenchRequest]:
    """A mixed workload (uniform lengths; ``shared_fraction`` of prompts start with one common
    ``shared_prefix_tokens`` system prompt). Arrival times are set by the rate at replay."""
    if num_requests < 1:
        raise InputError(f"--num-requests={num_requests} must be >= 1")
    rng = np.random.default_rng(seed)
    system = token_block(10**9, shared_prefix_tokens, vocab, seed)
    out = []
    for _ in range(num_requests):
        n_in = int(rng.integers(input_tokens[0], input_tokens[1] + 1))
        n_out = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        own = rng.integers(1, vocab, n_in).tolist()
        prompt = (system + own)[:n_in] if rng.random() < shared_fraction else own
        out.append(BenchRequest(0.0, prompt, n_out))
    return out


def poisson_arrivals(requests: list[BenchRequest], rate: float, seed: int = 0) -> None:
    """Set arrival times of a Poisson process of ``rate`` requests/s (``inf``: all at once)."""
    if not rate > 0:
        raise InputError(f"--rate={rate} must be > 0 (inf: all at once)")
    gaps = (
        np.zeros(len(requests))
        if np.isinf(rate)
        else np.random.default_rng(seed).exponential(1 / rate, len(requests))
    )
    for r, t in zip(requests, np.cumsum(gaps) - gaps[0], strict=True):
        r.arrival_s = float(t)


async def stream_request(
    client, url: str, model: str, req: BenchRequest, start: float, slots=None
) -> BenchResult:
    """Send ``req`` at its arrival time (once one of ``slots``, an ``asyncio.Semaphore``, is free)
    and time its stream from the moment it is sent."""
    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
    async with slots or contextlib.nullcontext():
        return await _stream(client, url, model, req, start)


async def _stream(client, url: str, model: str, req: BenchRequest, start: float) -> BenchResult:
    result = BenchResult(req.arrival_s, len(req.prompt_ids))
    body = {
        "model": model,
        "prompt": req.prompt_ids,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    result.sent_s = sent - start
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {text[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "error")
                    break
                now = time.perf_counter()
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    details = event["usage"].get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens", 0)
                elif event["choices"] and event["choices"][0]["finish_reason"] is None:
                    if result.ttft_s is None:
                        result.ttft_s = now - sent
                    else:
                        result.itl_s.append(now - last)
                    last = now
        result.latency_s = (last or time.perf_counter()) - sent
    except Exception as err:  # a refused or dropped connection is a measured error
        result.error = f"{type(err).__name__}: {err}"
    return result


async def replay(
    url: str,
    requests: list[BenchRequest],
    *,
    timeout_s: float = 600.0,
    progress=None,
    max_concurrency: int | None = None,
) -> tuple[list[BenchResult], float]:
    """Send every request at its arrival time, or later while ``max_concurrency`` requests are in
    flight (as vLLM's benchmark does: the wait is not part of TTFT); ``(results in request order,
    wall seconds)``."""
    import httpx

    if max_concurrency is not None and max_concurrency < 1:
        raise InputError(f"--max-concurrency={max_concurrency} must be >= 1")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = url.rstrip("/").removesuffix("/v1")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        try:
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
            raise InputError(
                f"--url={url!r}: no OpenAI-compatible server answers ({err})"
            ) from None
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(stream_request(client, url, model, r, start, slots))
            for r in requests
        ]
        if progress is not None:
            for task in tasks:
                task.add_done_callback(lambda _: progress())
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def percentiles(values, qs=(50, 90, 95, 99)) -> dict[str, float | None]:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return {f"p{q}": (float(np.percentile(arr, q)) if arr.size else None) for q in qs}


def summarize(results: list[BenchResult], wall_s: float) -> dict:
    """Percentiles (seconds), throughput (tokens/s), cache hit rate and errors of a replay."""
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s,
        "ttft_s": percentiles(r.ttft_s for r in ok),
        "tpot_s": percentiles(r.tpot_s for r in ok),
        "itl_s": percentiles(x for r in ok for x in r.itl_s),
        "throughput": {
            "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
            "input_tokens_per_s": prompt / wall_s if wall_s > 0 else 0.0,
            "output_tokens_per_s": output / wall_s if wall_s > 0 else 0.0,
        },
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
    }


def plot(results: list[BenchResult], path: Path, title: str = "serve bench") -> Path:
    """TTFT, TPOT and inter-token latency distributions (CDFs) in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.error is None]
    series = {
        "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
        "TPOT": [r.tpot_s for r in ok if r.tpot_s is not None],
        "inter-token": [x for r in ok for x in r.itl_s],
    }
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            x = np.sort(np.asarray(values)) * 1e3
            ax.plot(x, np.arange(1, x.size + 1) / x.size)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "inter-token" else "fraction of gaps")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: {len(ok)} of {len(results)} requests completed")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def synthetic_trace(
    path: str | Path,
    num_requests: int,
    rate: float,
    *,
    block_tokens: int = 64,
    input_tokens: tuple[int, int] = (100, 500),
    output_tokens: tuple[int, int] = (16, 64),
    shared_fraction: float = 0.5,
    seed: int = 0,
) -> Path:
    """Write a Mooncake-style trace: Poisson arrivals at ``rate``/s, uniform lengths, and
    ``shared_fraction`` of prompts opening with one common ``block_tokens`` system-prompt block
    (``hash_ids`` name every block, so replaying it live and simulating it share the same prefixes)."""
    if num_requests < 1 or not rate > 0:
        raise InputError(f"num_requests={num_requests} must be >= 1 and rate={rate} > 0")
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, num_requests))
    times -= times[0]
    lines, next_block = [], 1
    for t in times:
        n_in = int(rng.integers(input_tokens[0], input_tokens[1] + 1))
        blocks = -(-n_in // block_tokens)
        shared = rng.random() < shared_fraction
        hashes = ([0] if shared else []) + list(range(next_block, next_block + blocks - shared))
        next_block += blocks
        lines.append(
            json.dumps(
                {
                    "timestamp": round(float(t) * 1e3, 3),
                    "input_length": n_in,
                    "output_length": int(rng.integers(output_tokens[0], output_tokens[1] + 1)),
                    "hash_ids": hashes,
                }
            )
        )
    write_text_atomic(Path(path), "\n".join(lines) + "\n")
    return Path(path)
