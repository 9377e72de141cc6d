"""``moeinfra serve calibrate --url URL``: fit the serving model to a live server's engine steps.

The server keeps its units' recent engine steps (``GET /calibration/steps``: per step, the busiest
rank's tokens, attended keys and sampled rows and the slowest rank's seconds). Calibrating sends a
probe load that spans the step sizes — single prompts of growing length, bursts of prompts, and
decode batches from one request up to the decode slots — reads the steps back, bins similar ones
(median seconds), and fits the performance model's factors on two bins in three, validating on
the third (:func:`moeinfra.serving.calibration.fit_calibration`). The hardware is this host's
measured single-thread matmul rate and copy bandwidth; the model is the server's ``config.json``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np

from moeinfra.errors import InputError
from moeinfra.server.bench import BenchRequest, replay, token_block
from moeinfra.serving.calibration import (
    Calibration,
    StepPoint,
    fit_calibration,
    jitter_quantiles,
    model_spec,
)
from moeinfra.serving.specs import Deployment, HardwareSpec

#: Token ids of probe prompts are drawn below this (any id the tokenizer knows; step times do not
#: depend on which).
PROBE_VOCAB = 1000
PHASES_OF_ROLE = {
    "prefill": ("prefill",),
    "decode": ("decode",),
    "colocated": ("prefill", "decode"),
}


def measure_host(ranks: int, seconds: float = 0.3) -> HardwareSpec:
    """This host as a :class:`HardwareSpec` of ``ranks`` "GPUs" (one engine rank each, one thread):
    FP32 matmul rate for both compute figures, memory copy bandwidth for HBM and the links."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(256, 256)
        flops = []
        began = time.perf_counter()
        while time.perf_counter() - began < seconds:
            t = time.perf_counter()
            for _ in range(8):
                a @ a
            flops.append(8 * 2 * 256**3 / (time.perf_counter() - t))
        src = torch.empty(8 << 20)
        dst = torch.empty_like(src)
        copies = []
        began = time.perf_counter()
        while time.perf_counter() - began < seconds:
            t = time.perf_counter()
            dst.copy_(src)
            copies.append(2 * src.numel() * 4 / (time.perf_counter() - t))
    finally:
        torch.set_num_threads(threads)
    tflops = float(np.median(flops)) / 1e12
    gb_s = float(np.median(copies)) / 1e9
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / max(ranks, 1)
    return HardwareSpec(
        name=f"cpu:{os.uname().nodename}",
        gpus_per_node=ranks,
        fp8_tflops=tflops,
        bf16_tflops=tflops,
        hbm_gb=memory_gb,
        hbm_tb_per_s=gb_s / 1e3,
        nvlink_gb_per_s=gb_s,
        rdma_gb_per_s=gb_s,
        num_sms=1,
        gpu_hour_usd=0.0,
    )


def probe_load(
    vocab: int, max_prompt: int, decode_slots: int, seed: int = 0
) -> list[list[BenchRequest]]:
    """Waves of requests (waves one after another) that span the steps: single prompts of 16
    tokens up to ``max_prompt``, bursts of 2-8 prompts, decode batches of 1 request up to
    ``decode_slots`` (each of these sent at once), and decode batches with prompts arriving one by
    one while they decode (steps of units that compute at the same time). :func:`steady_load`
    follows them."""
    rng = np.random.default_rng(seed)
    tag = iter(range(1 << 30))

    def prompt(n: int) -> list[int]:  # never seen before: no prefix-cache hits
        return token_block(10**12 + seed * 10**6 + next(tag), n, vocab)

    waves = []
    lengths = np.unique(np.geomspace(16, max(max_prompt, 16), 7).astype(int))
    for n in np.r_[lengths, lengths]:
        waves.append([BenchRequest(0.0, prompt(int(n)), 2)])
    for k in (2, 3, 4, 6, 8):
        sizes = rng.integers(32, max(min(max_prompt, 512), 33), k)
        waves.append([BenchRequest(0.0, prompt(int(n)), 2) for n in sizes])
    batch = 1
    while batch <= decode_slots:
        sizes = rng.integers(16, max(min(max_prompt // 2, 384), 17), batch)
        waves.append([BenchRequest(0.0, prompt(int(n)), 48) for n in sizes])
        batch *= 2
    for batch in (2, min(8, decode_slots)):
        wave = [BenchRequest(0.0, prompt(64), 96) for _ in range(batch)]
        sizes = np.geomspace(64, max(max_prompt // 2, 64), 8).astype(int)
        wave += [
            BenchRequest(0.3 + 0.3 * i, prompt(int(n)), 2)
            for i, n in enumerate(rng.permutation(sizes))
        ]
        waves.append(wave)
    return waves


def steady_load(
    vocab: int, max_prompt: int, rate: float, seed: int = 0, requests: int = 96
) -> list[BenchRequest]:
    """Serving traffic: Poisson arrivals at ``rate``/s, prompts of 64 to ``max_prompt / 2``
    tokens never seen before, 16-64 output tokens (prefill and decode steps at the same time)."""
    rng = np.random.default_rng(seed + 1)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, requests))
    return [
        BenchRequest(
            float(t - arrivals[0]),
            token_block(2 * 10**12 + seed * 10**6 + i, int(n), vocab),
            int(m),
        )
        for i, (t, n, m) in enumerate(
            zip(
                arrivals,
                rng.integers(64, max(max_prompt // 2, 65), requests),
                rng.integers(16, 65, requests),
                strict=True,
            )
        )
    ]


def contended_share(steps: list[dict], others: list[dict]) -> np.ndarray:
    """For each of ``steps`` (dicts with ``seconds`` and ``ended``), the share of its time during
    which any of ``others`` ran (the union of their intervals)."""
    if not steps:
        return np.zeros(0)
    end = np.array([s["ended"] for s in steps])
    start = end - np.array([s["seconds"] for s in steps])
    if not others:
        return np.zeros(len(steps))
    o_end = np.array([s["ended"] for s in others])
    o_start = o_end - np.array([s["seconds"] for s in others])
    order = np.argsort(o_start)
    o_start, o_end = o_start[order], np.maximum.accumulate(o_end[order])
    # merge into disjoint intervals: a new one begins where a start passes every earlier end
    begins = np.r_[True, o_start[1:] > o_end[:-1]]
    lo = o_start[begins]
    hi = o_end[np.r_[np.flatnonzero(begins)[1:] - 1, o_end.size - 1]]
    before = np.r_[0.0, np.cumsum(hi - lo)]  # covered time before each merged interval

    def covered(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(lo, t, side="right") - 1
        inside = np.minimum(t, hi[np.maximum(i, 0)]) - lo[np.maximum(i, 0)]
        return np.where(i >= 0, before[np.maximum(i, 0)] + inside, 0.0)

    return np.clip((covered(end) - covered(start)) / np.maximum(end - start, 1e-12), 0.0, 1.0)


def boundaries_within(steps: list[dict], others: list[dict]) -> np.ndarray:
    """For each of ``steps`` (dicts with ``seconds`` and ``ended``), how many of ``others``
    started or ended inside it."""
    if not steps:
        return np.zeros(0, dtype=np.int64)
    end = np.array([s["ended"] for s in steps])
    start = end - np.array([s["seconds"] for s in steps])
    o_end = np.array([s["ended"] for s in others])
    edges = np.sort(np.r_[o_end - np.array([s["seconds"] for s in others]), o_end])
    return np.searchsorted(edges, end, side="left") - np.searchsorted(edges, start, side="right")


def _binned_steps(units: list[dict]) -> dict[tuple, list[dict]]:
    """The steps of ``units`` (of ``GET /calibration/steps``) in bins of like steps (see
    :func:`step_points`), keyed by (phase, unit shape, size, keys, contention, interrupts)."""
    bins: dict[tuple, list[dict]] = defaultdict(list)
    for k, unit in enumerate(units):
        engine = unit["engine"]
        shape = (
            unit["ranks"],
            int(engine.get("redundant_experts") or 0),
            2 if unit["ranks"] > 1 else 1,
        )
        others = [s for j, u in enumerate(units) if j != k for s in u["steps"]]
        shares = contended_share(unit["steps"], others)
        edges = boundaries_within(unit["steps"], [s for s in others if s["phase"] == "prefill"])
        for s, share, edge in zip(unit["steps"], shares, edges, strict=True):
            phase = s["phase"]
            if phase not in PHASES_OF_ROLE[unit["role"]]:
                continue
            keys = s["attended_keys"] / max(s["tokens"], 1)
            size = round(np.log2(s["tokens"]) * 4) if phase == "prefill" else s["tokens"]
            edge = int(edge) if phase == "decode" else 0
            key = (phase, shape, size, round(np.log2(keys + 1) * 2), round(float(share) * 2))
            bins[(*key, min(edge, 3))].append(
                s | {"keys": keys, "contended": float(share), "interrupts": edge}
            )
    return bins


def step_points(units: list[dict]) -> list[StepPoint]:
    """Binned :class:`StepPoint` of the ``units`` of ``GET /calibration/steps`` (prefill steps of
    prefill and colocated units, decode steps of decode and colocated units; mixed steps left out).
    A bin: one phase and unit shape, tokens within a quarter octave (prefill) or equal (decode),
    attended keys per token within half an octave, the share of the step during which another
    unit stepped (the units share this host's cores) in thirds, and for decode how many prefill
    steps of other units started or ended inside it (0, 1, 2, 3 or more)."""
    points = []
    for (phase, (_ranks, redundant, mb), *_), rows in sorted(_binned_steps(units).items()):
        points.append(
            StepPoint(
                phase,
                tokens=float(np.mean([r["tokens"] for r in rows])),
                keys=float(np.mean([r["keys"] for r in rows])),
                sampled=float(np.mean([r["sampled"] for r in rows])),
                seconds=float(np.median([r["seconds"] for r in rows])),
                nodes=1,
                redundant_experts=redundant,
                micro_batches=mb,
                steps=len(rows),
                contended=float(np.mean([r["contended"] for r in rows])),
                interrupts=float(np.mean([r["interrupts"] for r in rows])),
            )
        )
    return points


def prefill_step_spread(units: list[dict]) -> np.ndarray:
    """Each prefill step's time over the median of its bin (:func:`step_points`; bins of at least
    three steps): how much like steps vary on this host."""
    ratios = [
        np.array([r["seconds"] for r in rows]) / np.median([r["seconds"] for r in rows])
        for key, rows in _binned_steps(units).items()
        if key[0] == "prefill" and len(rows) >= 3
    ]
    return np.concatenate(ratios) if ratios else np.zeros(0)


async def _get_steps(url: str) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        try:
            r = await client.get(f"{url}/calibration/steps")
            r.raise_for_status()
            return r.json()
        except (httpx.HTTPError, ValueError) as err:
            raise InputError(
                f"--url={url!r}: no moeinfra server answers GET /calibration/steps ({err})"
            ) from None


def calibrate_live(
    url: str, *, name: str | None = None, seed: int = 0, progress=None
) -> Calibration:
    """Probe the server at ``url``, read its steps back and fit a calibration."""
    url = url.rstrip("/").removesuffix("/v1")
    info = asyncio.run(_get_steps(url))
    units = info["units"]
    if not units:
        raise InputError(f"--url={url!r}: the server has no live unit to measure")
    ranks = {u["ranks"] for u in units}
    if len(ranks) != 1:
        raise InputError(
            f"--url={url!r}: units of {sorted(ranks)} ranks; calibrate needs one rank count "
            "(serve up with equal --prefill-ranks and --decode-ranks)"
        )
    config = info["config"]
    decode = [u for u in units if u["role"] != "prefill"]
    prefill = [u for u in units if u["role"] != "decode"]
    engine, prefill_engine = decode[0]["engine"], prefill[0]["engine"]
    slots = sum(u["engine"]["max_num_seqs"] * u["ranks"] for u in decode)
    max_prompt = min(
        int(prefill_engine["max_num_batched_tokens"]),
        int(engine["num_kv_blocks"]) * int(engine["block_size"]) // 4,
        1024,
    )
    # never more in flight than the server holds: a loaded host would otherwise refuse the
    # prompts that pile up behind a slow step
    in_flight = int(info.get("capacity") or slots)
    waves = probe_load(PROBE_VOCAB, max_prompt, min(slots, 64), seed)
    for wave in waves:
        results, _ = asyncio.run(replay(url, wave, max_concurrency=in_flight))
        failed = [r.error for r in results if r.error]
        if failed:
            raise InputError(f"--url={url!r}: a probe request failed: {failed[0]}")
        if progress is not None:
            progress()
    # serving traffic: Poisson arrivals at a quarter of the prefill unit's pace
    prefill_steps = _prefill_seconds(asyncio.run(_get_steps(url)))
    rate = 0.25 * len(prefill) / float(np.median(prefill_steps))
    steady = steady_load(PROBE_VOCAB, max_prompt, rate, seed)
    steady_results, _ = asyncio.run(replay(url, steady, max_concurrency=in_flight))
    failed = [r.error for r in steady_results if r.error]
    if failed:
        raise InputError(f"--url={url!r}: a probe request failed: {failed[0]}")
    seen = _last_steps(asyncio.run(_get_steps(url)))
    alone = asyncio.run(
        # (prompts of this seed's own: another calibration's are in the server's prefix caches)
        _one_at_a_time(url, [token_block(-1 - i, 64, PROBE_VOCAB, seed) for i in range(9)])
    )
    info = asyncio.run(_get_steps(url))
    points = step_points(info["units"])
    ranks_per_unit = ranks.pop()
    hw = measure_host(ranks_per_unit)
    redundant = int(engine.get("redundant_experts") or 0)
    mb = 2 if ranks_per_unit > 1 else 1
    calibration = fit_calibration(
        name or f"live-{os.uname().nodename}",
        f"moeinfra serve calibrate --url {url} (model {info['model']}, "
        f"{len(units)} unit(s) of {ranks_per_unit} rank(s), {time.strftime('%Y-%m-%d')})",
        points,
        hw,
        model_spec(config, info["model"]),
        gemm_table="flat",
        units={
            "prefill": Deployment(
                "prefill",
                1,
                redundant_experts=int(prefill_engine.get("redundant_experts") or 0),
                micro_batches=mb,
                tokens_per_gpu=int(prefill_engine["max_num_batched_tokens"]),
            ),
            "decode": Deployment("decode", 1, redundant_experts=redundant, micro_batches=mb),
        },
        kv_tokens_per_gpu=float(int(engine["num_kv_blocks"]) * int(engine["block_size"])),
    )
    calibration = replace(
        calibration, prefill_step_jitter=jitter_quantiles(prefill_step_spread(info["units"]))
    )
    overhead = {"request_overhead_s": request_overhead(alone, _prefill_seconds(info, after=seen))}
    if not any(u["role"] == "colocated" for u in units):
        overhead |= request_overhead_under_load(
            calibration, steady, steady_results, len(prefill), len(decode)
        )
    return replace(calibration, factors=calibration.factors | overhead)


async def _one_at_a_time(url: str, prompts: list[list[int]]) -> list[float | None]:
    """Time to first token of ``prompts`` sent one after another, each on a new connection as
    most requests of a replay are (the first, a warm-up, left out)."""
    import httpx

    from moeinfra.server.bench import stream_request

    async with httpx.AsyncClient(timeout=60) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
    out = []
    for ids in prompts:
        async with httpx.AsyncClient(timeout=60) as client:
            r = await stream_request(
                client, url, model, BenchRequest(0.0, ids, 1), time.perf_counter()
            )
        if r.error is not None:
            raise InputError(f"--url={url!r}: a probe request failed: {r.error}")
        out.append(r.ttft_s)
    return out[1:]


def _prefill_seconds(info: dict, after: dict[str, int] | None = None) -> list[float]:
    """Seconds of the prefill steps of a ``GET /calibration/steps`` answer (of each unit, only
    those numbered after ``after[unit]``)."""
    after = after or {}
    return [
        s["seconds"]
        for u in info["units"]
        if u["role"] != "decode"
        for s in u["steps"]
        if s["phase"] == "prefill" and s["step"] > after.get(u["unit"], -1)
    ]


def _last_steps(info: dict) -> dict[str, int]:
    """The latest step number of each unit of a ``GET /calibration/steps`` answer."""
    return {u["unit"]: max((s["step"] for s in u["steps"]), default=-1) for u in info["units"]}


def request_overhead(ttft_s: list[float], step_s: list[float]) -> float:
    """A request's time outside the engine step that computes its first token (API server,
    router, transport): the median time to first token of prompts sent alone less the median of
    the prefill steps they ran (>= 0)."""
    ttft_s = [t for t in ttft_s if t is not None]
    if not ttft_s or not step_s:
        return 0.0
    return max(float(np.median(ttft_s) - np.median(step_s)), 0.0)


def request_overhead_under_load(
    calibration: Calibration,
    requests: list[BenchRequest],
    results,
    prefill_units: int,
    decode_units: int,
) -> dict[str, float]:
    """A request's time outside the engine steps while the server serves traffic
    (``request_overhead_loaded_s``): the median time to first token of ``requests`` (sent as a
    replay, measured as ``results``) less the median the calibrated simulator gives them with no
    such time (>= 0); and the output tokens a second they offered (``overhead_load_tokens_per_s``).
    Longer than on prompts sent alone: under traffic the API server and the client stream other
    requests' tokens on the cores the units compute on (:meth:`Calibration.at_load`)."""
    live = [r.ttft_s for r in results if r.ttft_s is not None]
    if not live:
        return {}
    bare = replace(calibration, factors=calibration.factors | {"request_overhead_s": 0.0})
    cached = [r.cached_tokens for r in results]
    workload = requests_workload(requests, cached)
    simulated = simulated_ttft(bare, workload, prefill_units, decode_units)
    return {
        "request_overhead_loaded_s": max(float(np.median(live) - np.median(simulated)), 0.0),
        "overhead_load_tokens_per_s": workload.output_tokens_per_s,
    }


def requests_workload(requests: list[BenchRequest], cached_tokens: list[int]):
    """``requests`` (arrivals and lengths as sent, ``cached_tokens`` as served) as a workload."""
    from moeinfra.serving.workload import Workload

    arrival = np.array([r.arrival_s for r in requests])
    return Workload(
        arrival_s=arrival - arrival.min(),
        input_tokens=np.array([len(r.prompt_ids) for r in requests], dtype=np.int64),
        output_tokens=np.array([r.max_tokens for r in requests], dtype=np.int64),
        cached_tokens=np.asarray(cached_tokens, dtype=np.int64),
        duration_s=float(np.ptp(arrival)) + 1.0,
        name="requests sent",
    )


def simulated_ttft(
    calibration: Calibration, workload, prefill_units: int, decode_units: int, trials: int = 8
) -> np.ndarray:
    """Times to first token of ``workload`` (:func:`requests_workload`) on ``prefill_units``
    and ``decode_units`` units under ``calibration``; with a step-time spread, ``trials`` draws
    pooled."""
    from moeinfra.serving.simulate import COMPLETED

    runs = _simulated_replays(workload, calibration, prefill_units, decode_units, 0.005, trials)
    return np.concatenate([r.ttft_s[r.status == COMPLETED] for r in runs])


def _simulated_replays(workload, calibration, prefill_units, decode_units, tick_s, trials):
    """Runs of ``workload`` on a fixed fleet under ``calibration``, drained: one, or with a
    step-time spread in force, ``trials`` with different draws."""
    from moeinfra.serving.scenario import build_scenario
    from moeinfra.serving.simulate import SimConfig

    scenario = build_scenario(
        workload=workload, fleet=(prefill_units, decode_units), calibration=calibration
    )
    return [
        scenario.run(SimConfig(tick_s=tick_s, record_every_s=1.0, drain_s=600.0, seed=seed))
        for seed in range(trials if calibration.prefill_step_jitter else 1)
    ]


def predict_replay(
    trace: str | Path,
    calibration: Calibration,
    *,
    prefill_units: int = 1,
    decode_units: int = 1,
    block_tokens: int = 64,
    tick_s: float = 0.005,
    trials: int = 8,
) -> dict:
    """The calibrated simulator's figures for replaying ``trace`` on a fixed fleet, in the shape of
    :func:`moeinfra.server.bench.summarize` (latency percentiles in seconds, throughput over the
    time from the first arrival to the last finish). With a step-time spread in the calibration,
    ``trials`` simulations with different draws are pooled (latencies) and averaged (throughput):
    the prediction is the expected replay, not one draw of it."""
    from moeinfra.server.bench import percentiles
    from moeinfra.serving.simulate import COMPLETED
    from moeinfra.serving.workload import read_trace

    workload, _ = read_trace(trace, hash_block_tokens=block_tokens)
    ttft, tpot, speed, completed = [], [], [], []
    for result in _simulated_replays(
        workload, calibration, prefill_units, decode_units, tick_s, trials
    ):
        done = result.status == COMPLETED
        span = float(np.nanmax(result.finish_s)) if done.any() else float("nan")
        ttft.append(result.ttft_s[done])
        tpot.append(result.tpot_s[done & np.isfinite(result.tpot_s)])
        speed.append(float(workload.output_tokens[done].sum()) / span if span > 0 else 0.0)
        completed.append(int(done.sum()))
    return {
        "requests": int(workload.size),
        "completed": min(completed),
        "ttft_s": percentiles(np.concatenate(ttft)),
        "tpot_s": percentiles(np.concatenate(tpot)),
        "throughput": {"output_tokens_per_s": float(np.mean(speed))},
        "cache_hit_rate": float(workload.cached_tokens.sum() / workload.input_tokens.sum()),
    }


#: Figures compared between a live replay and the calibrated simulator.
COMPARED = (
    ("TTFT p50 (s)", ("ttft_s", "p50")),
    ("TTFT p95 (s)", ("ttft_s", "p95")),
    ("TPOT p50 (s)", ("tpot_s", "p50")),
    ("TPOT p95 (s)", ("tpot_s", "p95")),
    ("output tokens/s", ("throughput", "output_tokens_per_s")),
)


def compare(live: dict, predicted: dict) -> list[dict]:
    """Rows ``{figure, live, predicted, error}`` (error = predicted / live - 1)."""
    rows = []
    for label, (group, key) in COMPARED:
        a, b = live[group][key], predicted[group][key]
        error = b / a - 1.0 if a and b is not None else None
        rows.append({"figure": label, "live": a, "predicted": b, "error": error})
    return rows
