"""Discrete-event simulation of a prefill/decode-disaggregated fleet, advanced in fixed ticks.

Request flow: API server -> prefill load balancer (least outstanding work over prefill units) ->
prefill unit (whole steps; cache-hit prefix read from the on-disk KV cache, the rest computed) -> KV transfer
-> decode load balancer (least KV usage over decode units, within the KV capacity) -> decode unit
(continuous batching: every request in the unit advances one token per decode step) -> response.

Method (docs/serving-model.md): each sampled request stands for ``workload.scale`` real requests; a
unit's batch is ``scale`` x its sampled requests; prefill units run whole steps of the prompts
waiting (:class:`~moeinfra.serving.prefill_queue.PrefillQueue`, fed once per tick); decode advances every
request by ``tick / step_time`` tokens per tick, with the step time of its unit's current batch
from the performance model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moeinfra.errors import InputError
from moeinfra.serving.balancers import fill_least_loaded
from moeinfra.serving.cost import R1_PRICES, Prices, fleet_cost_usd, margin, revenue_usd
from moeinfra.serving.decode_batch import admit_ready, advance_batch, batch_load
from moeinfra.serving.perfmodel import V4_ASSUMPTIONS, PerfModel
from moeinfra.serving.prefill_ticks import PrefillShare, PrefillTicks
from moeinfra.serving.schedule import FleetSchedule
from moeinfra.serving.unit_cost import BALANCERS, prefill_cost
from moeinfra.serving.workload import REFUSED_REASONS, Workload, real_count, real_parts

COMPLETED, RUNNING, REJECTED = 0, 1, 2
REJECT_REASONS = ("prefill queue over max wait", "decode KV cache full past max wait")


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the simulation (not of the system being simulated, except the SLO-ish limits).

    tick_s: decode time step. max_prefill_wait_s / max_decode_wait_s: queueing beyond which a request
    is rejected. balancer: ``"deepseek"`` (the balancers of this package) or ``"baseline"``
    (round robin / least requests) for the DP ranks inside a unit. drain_s: after the workload's
    window, go on simulating for up to this long so the requests in flight finish (their tokens
    and latencies count; the fleet's cost stays the window's). seed: of the simulation's own
    draws (the unseen prompts of sampled requests, prefill step-time jitter).
    """

    tick_s: float = 2.0
    max_prefill_wait_s: float = 300.0
    max_decode_wait_s: float = 300.0
    balancer: str = "deepseek"
    prices: Prices = R1_PRICES
    record_every_s: float = 60.0
    drain_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.drain_s < float("inf"):
            raise InputError(f"drain_s={self.drain_s} must be >= 0 and finite")
        if self.tick_s <= 0 or self.record_every_s < self.tick_s:
            raise InputError(
                f"tick_s={self.tick_s} must be > 0 and record_every_s={self.record_every_s} >= tick_s"
            )
        if self.balancer not in BALANCERS:
            raise InputError(f"balancer={self.balancer!r} must be 'deepseek' or 'baseline'")


@dataclass
class SimulationResult:
    """What a simulation recorded (real-scale figures unless the name says ``sampled``).

    Per request (sampled, ``[n]``): ``status`` (0 completed, 1 running, 2 rejected), ``reason``
    (index into REJECT_REASONS or -1), ``ttft_s``, ``tpot_s`` (mean time per output token after the
    first), ``finish_s``. Per output token (real scale, a histogram): ``itl_edges_s`` ``[b + 1]``
    and ``itl_tokens`` ``[b]``, the tokens generated at each inter-token latency (the step time of
    their unit when they were generated). Per record interval (``[k]`` rows, ``[k, units]`` per unit):
    ``decode_batch_per_gpu``, ``decode_kv_usage``, ``decode_step_s``, ``prefill_utilisation``.
    ``hourly``: one dict per hour. ``totals``: the day's figures. ``refused``: sampled requests
    refused on arrival, never served, by reason (:data:`~moeinfra.serving.workload.REFUSED_REASONS`:
    a replayed trace's requests longer than the model's context). Counts of requests and tokens
    are integers: sampled sums times ``scale``, rounded once
    (:func:`~moeinfra.serving.workload.real_parts`).
    """

    scale: float
    duration_s: float
    status: np.ndarray
    reason: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    finish_s: np.ndarray
    output_tokens: np.ndarray
    record_t_s: np.ndarray
    decode_batch_per_gpu: np.ndarray
    decode_kv_usage: np.ndarray
    decode_step_s: np.ndarray
    prefill_utilisation: np.ndarray
    itl_edges_s: np.ndarray
    itl_tokens: np.ndarray
    hourly: list[dict]
    totals: dict
    model: dict = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)

    def _request_parts(self) -> tuple[list[str], list[int]]:
        """Real-scale requests by outcome (completed, running, then each rejection reason),
        adding up to the real arrivals exactly."""
        completed, running = (int(np.count_nonzero(self.status == k)) for k in (COMPLETED, RUNNING))
        reasons = np.bincount(self.reason[self.reason >= 0], minlength=len(REJECT_REASONS))
        names = ["completed", "running", *REJECT_REASONS, *REFUSED_REASONS]
        sampled = [completed, running, *(int(c) for c in reasons)]
        sampled += [int(self.refused.get(r, 0)) for r in REFUSED_REASONS]
        return names, real_parts(sampled, self.scale)

    def requests(self) -> dict[str, int]:
        """Real-scale request counts (integers); ``arrived == completed + running + rejected``
        always, the rejected including those refused on arrival (``rejected_by_reason`` in
        :meth:`to_dict`)."""
        names, real = self._request_parts()
        parts = dict(zip(names, real, strict=True))
        sampled = int(self.status.size) + sum(int(v) for v in self.refused.values())
        return {
            "arrived": real_count(sampled, self.scale),
            "completed": parts["completed"],
            "running": parts["running"],
            "rejected": sum(real[2:]),
            "sampled": sampled,
        }

    def itl_percentiles(self, quantiles=(50, 90, 95, 99)) -> dict[str, float]:
        """Token-weighted inter-token latency: percentiles (upper bin edge, bins 1.2% wide) and mean."""
        total = float(self.itl_tokens.sum())
        if total <= 0:
            return {}
        cumulative = np.cumsum(self.itl_tokens) / total
        upper = self.itl_edges_s[1:]
        mids = np.sqrt(self.itl_edges_s[:-1] * upper)
        out = {f"p{q}": float(upper[np.searchsorted(cumulative, q / 100.0)]) for q in quantiles}
        return out | {"mean": float((mids * self.itl_tokens).sum() / total)}

    def to_dict(self, hourly: bool = True) -> dict:
        """JSON-ready summary (the fields ``moeinfra serve simulate --json`` prints)."""
        out = dict(self.totals)
        out["requests"] = self.requests()
        names, real = self._request_parts()
        out["rejected_by_reason"] = dict(zip(names[2:], real[2:], strict=True))
        done = self.status == COMPLETED
        out["ttft_s"] = _percentiles(self.ttft_s[np.isfinite(self.ttft_s)])
        out["tpot_s"] = _percentiles(self.tpot_s[done & np.isfinite(self.tpot_s)])
        out["itl_s"] = self.itl_percentiles()
        out["model"] = self.model
        if hourly:
            out["hourly"] = self.hourly
        return json_ready(out)


def _percentiles(values: np.ndarray) -> dict[str, float]:
    """p50/p90/p95/p99 and mean of ``values`` (a copy it may reorder: no second copy)."""
    if not values.size:
        return {}
    mean = float(values.mean())
    qs = (50, 90, 95, 99)
    at = np.percentile(values, qs, overwrite_input=True)
    return {f"p{q}": float(v) for q, v in zip(qs, at, strict=True)} | {"mean": mean}


def json_ready(value):
    """Plain Python floats/ints, NaN and infinities as None (strict JSON)."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if np.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def prefill_after(spans: np.ndarray, unit: np.ndarray, since: np.ndarray) -> np.ndarray:
    """Per request (``unit``, joined at ``since``), the seconds its unit spends in ``spans``
    (rows ``(unit, start, end)``, disjoint per unit) after it joined."""
    out = np.zeros(unit.size)
    for u in np.unique(spans[:, 0]).astype(np.int64):
        mine = unit == u
        if not mine.any():
            continue
        start, end = spans[spans[:, 0] == u, 1], spans[spans[:, 0] == u, 2]
        overlap = end[None, :] - np.maximum(start[None, :], since[mine, None])
        out[mine] = np.maximum(overlap, 0.0).sum(axis=1)
    return out


def hourly_prompts(
    first_s: np.ndarray, end_s: float, inputs: np.ndarray, cached: np.ndarray, hours: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[hours]`` int64 sampled prompts with a first token before ``end_s`` by the hour of it
    (the last hour takes any later), and their input and cache-hit tokens; a chunk of requests at
    a time (no day-long temporaries)."""
    count, tokens, hits = (np.zeros(hours, dtype=np.int64) for _ in range(3))
    for lo in range(0, first_s.size, 1 << 18):
        first = first_s[lo : lo + (1 << 18)]
        served = first < end_s
        h = np.minimum(first[served] // 3600, hours - 1).astype(np.int64)
        count += np.bincount(h, minlength=hours)
        # float sums of int32 lengths are exact (< 2**53)
        tokens += np.bincount(h, inputs[lo : lo + first.size][served], hours).astype(np.int64)
        hits += np.bincount(h, cached[lo : lo + first.size][served], hours).astype(np.int64)
    return count, tokens, hits


def fullest_rank_requests(requests, ranks: int):
    """Requests on the fullest of ``ranks`` ranks sharing ``requests`` as evenly as whole
    requests allow: ``ceil(requests / ranks)`` at whole counts, linear in between (``requests`` is
    an occupancy-weighted mean over a tick)."""
    requests = np.asarray(requests, dtype=np.float64)
    whole = np.floor(requests)
    below, above = np.ceil(whole / ranks), np.ceil((whole + 1) / ranks)
    return below + (requests - whole) * (above - below)


def simulate(
    workload: Workload,
    schedule: FleetSchedule,
    prefill: PerfModel,
    decode: PerfModel,
    config: SimConfig | None = None,
    *,
    progress: Callable[[float], None] | None = None,
    prefill_share: PrefillShare | None = None,
) -> SimulationResult:
    """Run ``workload`` on the fleet ``schedule`` of ``prefill``/``decode`` units.

    ``progress(t_s)`` is called every simulated minute. ``prefill_share``: the same object given
    to several runs that differ only in decode (a calibration's range runs): the first keeps its
    prefill ticks, the later ones with the same prefill side read them back instead of running
    the prefill queue again (:class:`~moeinfra.serving.prefill_ticks.PrefillShare`; the figures
    are those of a run of their own). Returns a :class:`SimulationResult`.
    """
    cfg = config or SimConfig()
    if prefill.dep.phase != "prefill" or decode.dep.phase != "decode":
        raise InputError("simulate needs a prefill PerfModel and a decode PerfModel")
    if schedule.prefill_nodes != prefill.dep.nodes or schedule.decode_nodes != decode.dep.nodes:
        raise InputError(
            f"schedule units ({schedule.prefill_nodes}/{schedule.decode_nodes} nodes) do not match "
            f"the deployments ({prefill.dep.nodes}/{decode.dep.nodes} nodes)"
        )
    S = workload.scale
    duration = min(workload.duration_s, schedule.duration_s)
    n = workload.size
    # per request: 20 bytes of workload, ~90 of state with the prefill queue (docs/serving-model.md, section 4)
    arrival, inputs, outputs = workload.arrival_s, workload.input_tokens, workload.output_tokens
    # ---- prefill cost per request (unit-seconds), from the performance model ----
    pc = prefill_cost(prefill, decode, workload, cfg.balancer)
    imb = pc.imbalance

    colocated = schedule.colocated

    def ready_s(idx):
        """When the KV cache of requests ``idx`` has reached decode (first token + transfer; a
        colocated unit decodes where it prefilled)."""
        if colocated:
            return first_token[idx]
        model = prefill.model
        kv_bytes = inputs[idx] * model.kv_bytes_per_token + model.kv_bytes_per_request
        transfer = kv_bytes / (prefill.hw.rdma_gb_per_s * 1e9)
        return first_token[idx] + transfer

    # ---- state ----
    p_max, d_max = schedule.max_units
    kv_cap_unit = decode.kv_capacity_tokens_per_gpu * decode.gpus
    # what a request takes of that capacity: its tokens, and (DeepSeek-V4) its window and
    # compressor state whatever its length
    overhead = decode.kv_request_overhead_tokens
    kv_inputs = inputs + overhead if overhead else inputs
    limit = decode.dep.max_batch_per_gpu
    batch_cap_unit = np.inf if limit is None else limit * decode.gpus
    if batch_cap_unit < S:
        raise InputError(
            f"max_batch_per_gpu={limit} x {decode.gpus} GPUs = {batch_cap_unit:g} requests per "
            f"unit, fewer than one sampled request (it stands for {S:g}): lower the sampling "
            "scale or raise the limit"
        )
    per_step = decode.dep.tokens_per_step  # output tokens a request gains per decode step
    status = np.full(n, RUNNING, dtype=np.int8)
    reason = np.full(n, -1, dtype=np.int8)
    first_token = np.full(n, np.nan)
    finish_t = np.full(n, np.nan)
    tpot = np.full(n, np.nan)  # mean time per output token after the first, once finished
    home = np.full(n if colocated else 0, -1, dtype=np.int32)  # colocated: the prefill unit
    prefill_busy = np.zeros(d_max)  # colocated: seconds of the tick each unit spends prefilling
    busy_spans = np.zeros((0, 3))  # colocated: (unit, start, end) of this tick's prefills
    pend = np.zeros(0, dtype=np.int64)  # waiting for a decode slot, by request index
    # active decode set
    a_idx = np.zeros(0, dtype=np.int64)
    a_unit = np.zeros(0, dtype=np.int64)
    a_done = np.zeros(0)
    a_from = np.zeros(0)

    ticks = int(np.ceil(duration / cfg.tick_s))
    last_tick = ticks + int(np.ceil(cfg.drain_s / cfg.tick_s)) - 1
    # the host factors describe units sharing a host's cores; a colocated unit's own prefills
    # stop its decoding outright (below), so they do not apply on top
    interrupt_s = 0.0 if colocated else decode.eff.decode_interrupt_s
    prefill_contention = 0.0 if colocated else prefill.eff.prefill_contention
    decode_contention = 0.0 if colocated else decode.eff.decode_contention
    # nothing decode does reaches the prefill side unless units share hosts or are the same units
    decoupled = not colocated and not prefill_contention
    key = PrefillShare.key(
        schedule, cfg.tick_s, ticks, duration, (cfg.max_prefill_wait_s, cfg.seed, last_tick)
    )
    share = prefill_share if decoupled else None
    if share is not None and share.matches(workload, pc, key, edges=bool(interrupt_s)):
        side = share.ticks
        share.reused += 1
    else:
        side = PrefillTicks(
            pc.queue(workload, p_max, cfg.max_prefill_wait_s, seed=cfg.seed),
            arrival, schedule, cfg.tick_s, ticks, duration, last_tick,
            keep=share is not None, keep_edges=bool(interrupt_s),
        )  # fmt: skip
        if share is not None:
            share.keep(side, workload, pc, key)
    rec_every = max(1, int(round(cfg.record_every_s / cfg.tick_s)))
    n_rec = -(-(last_tick + 1) // rec_every)
    rec_batch = np.zeros((n_rec, d_max))
    rec_kv = np.zeros((n_rec, d_max))
    rec_step = np.full((n_rec, d_max), np.nan)
    rec_putil = np.zeros((n_rec, p_max))
    hours = int(np.ceil(duration / 3600.0))
    # sampled whole tokens decoded by the hour (integers: totals are exact)
    out_hour = np.zeros(hours, dtype=np.int64)
    kv_weighted = decoded = 0.0
    itl_edges = np.geomspace(1e-4, 100.0, 1201)  # 0.1 ms .. 100 s, 1.16% per bin
    itl_tokens = np.zeros(itl_edges.size - 1)
    prev_d_units = None
    last_step = np.full(d_max, 0.02)
    prefill_edges = np.zeros(0)  # starts and ends of prefills, not yet reached
    behind = np.zeros(d_max)  # seconds each decode unit owes to prefill edges (shared host)
    work_done_rec = np.zeros(p_max)
    end = duration
    queued = 0  # requests in the prefill queue after the last tick
    for tick in range(last_tick + 1):
        if tick >= ticks and not (a_idx.size or pend.size or queued):
            break
        t0 = tick * cfg.tick_s
        t1 = min(t0 + cfg.tick_s, duration) if tick < ticks else t0 + cfg.tick_s
        end = max(end, t1)
        p_units, d_units = (int(x) for x in schedule.at(t0))
        # ---- arrivals -> prefill ----
        slowdown = 1.0
        if prefill_contention and a_idx.size:
            # units sharing the host's cores: the decode units computing slow the prefill
            busy_decode = np.unique(a_unit).size / max(d_units, 1)
            slowdown += prefill_contention * busy_decode
        if colocated:  # units still prefilling at t0, and until when
            carried = np.flatnonzero(side.queue.busy > t0)
            carried_end = side.queue.busy[carried]
        done = side.at(tick, slowdown)
        idx, fin, refused = done.idx, done.first_s, done.refused
        queued = done.pending
        if colocated:
            # when each unit prefills in this tick: the step carried in from t0, then the steps
            # started in it, clipped to the tick
            home[idx] = done.unit
            busy_spans = np.concatenate(
                [np.stack([carried, np.full(carried.size, t0), carried_end], axis=1), done.spans]
            )
            busy_spans[:, 1:] = np.clip(busy_spans[:, 1:], t0, t1)
            busy_spans = busy_spans[busy_spans[:, 2] > busy_spans[:, 1]]
            prefill_busy = np.bincount(
                busy_spans[:, 0].astype(np.int64), busy_spans[:, 2] - busy_spans[:, 1], p_max
            )
        status[refused] = REJECTED
        reason[refused] = 0
        work_done_rec += done.work
        first_token[idx] = fin
        if interrupt_s:
            prefill_edges = np.concatenate([prefill_edges, done.edges])
        pend = np.concatenate([pend, idx])
        # ---- scale-down: move decode requests off units that stop ----
        if prev_d_units is not None and d_units < prev_d_units and a_idx.size:
            moved = a_unit >= d_units
            if moved.any():
                kv_now = np.bincount(a_unit[~moved], (inputs[a_idx] + a_done)[~moved], d_max) * S
                levels = np.full(d_max, np.inf)
                levels[:d_units] = kv_now[:d_units]
                a_unit[moved] = fill_least_loaded(
                    levels, (inputs[a_idx[moved]] + a_done[moved]) * S
                )
        prev_d_units = d_units
        if interrupt_s:
            # units already decoding before this tick's arrivals (a request does not wait on
            # the end of its own prefill)
            decoding = np.bincount(a_unit, minlength=d_max)[:d_max] > 0
        # ---- decode admission ----
        if pend.size:
            a_idx, a_unit, a_done, a_from, pend = admit_ready(
                pend, ready_s(pend), t0, t1, a_idx, a_unit, a_done, a_from, kv_inputs, outputs,
                home, d_units, d_max, S, kv_cap_unit, batch_cap_unit, cfg.max_decode_wait_s,
                status, reason, REJECTED,
            )  # fmt: skip
        # ---- decode step ----
        r = tick // rec_every
        if interrupt_s:
            reached = prefill_edges < t1
            edges_now = int(reached.sum())
            prefill_edges = prefill_edges[~reached]
        if a_idx.size:
            run_s, remaining, count, kv_tokens = batch_load(
                a_idx, a_unit, a_done, a_from, inputs, outputs, last_step, t1, cfg.tick_s,
                per_step, d_max,
            )  # fmt: skip
            active = count > 0
            batch = np.where(active, count * S / decode.gpus, 0.0)
            # whole requests: the fullest DP rank holds at least ceil(requests / ranks), which
            # outweighs the balancer's sampled imbalance when a unit runs few requests per rank
            fullest = fullest_rank_requests(count * S, decode.gpus)
            paced = np.maximum(batch, fullest / imb["decode_requests"])
            mean_kv = np.where(active, kv_tokens / np.where(active, count, 1.0), 0.0)
            step = np.full(d_max, np.inf)
            step[active] = decode.decode_step_s(
                paced[active], mean_kv[active], imb["decode_requests"], imb["decode_kv"]
            )
            if decode_contention:
                # units sharing the host's cores: the prefill units' busy share of the tick
                step *= 1.0 + decode_contention * done.busy_share
            last_step = np.where(active, step, last_step)
            lost = np.zeros(d_max)
            if interrupt_s:
                # units sharing the host's cores: each prefill starting or ending costs decode
                behind += np.where(active & decoding, interrupt_s * edges_now, 0.0)
                lost = np.minimum(behind, cfg.tick_s)
                behind -= lost
            held = lost[a_unit]  # seconds of this tick each request cannot decode
            if colocated:
                # its unit's prefill time after the request joined (decoding waits through it)
                held = held + prefill_after(busy_spans, a_unit, a_from)
            running, produced, whole, kv_produced, unit_produced, unit_started = advance_batch(
                a_idx, a_unit, a_done, a_from, run_s, remaining, held, step, per_step, t1,
                inputs, outputs, first_token, finish_t, tpot, status, COMPLETED, d_max,
            )  # fmt: skip
            a_idx, a_unit, a_done, a_from = (x[:running] for x in (a_idx, a_unit, a_done, a_from))
            out_hour[min(int(t0 // 3600), hours - 1)] += whole
            decoded += produced * S
            kv_weighted += kv_produced * S
            unit_tokens = unit_produced[active] * S
            # a step's first token comes a step after the last; an accepted draft comes with it
            steps_tokens = unit_tokens / per_step
            itl_tokens[0] += unit_tokens.sum() * (1.0 - 1.0 / per_step)
            if colocated:
                # the first token of each request after the unit's prefills waited through them
                waited = unit_started[active] * S
                waited = np.where(prefill_busy[active] > 0, np.minimum(waited, steps_tokens), 0.0)
                after = step[active] + prefill_busy[active]
                bins = np.clip(np.searchsorted(itl_edges, after) - 1, 0, itl_tokens.size - 1)
                itl_tokens += np.bincount(bins, waited, itl_tokens.size)
                steps_tokens = steps_tokens - waited
            bins = np.clip(np.searchsorted(itl_edges, step[active]) - 1, 0, itl_tokens.size - 1)
            itl_tokens += np.bincount(bins, steps_tokens, itl_tokens.size)
            rec_batch[r] += batch / rec_every
            rec_kv[r] += kv_tokens * S / kv_cap_unit / rec_every
            rec_step[r] = np.where(active, step, rec_step[r])
        drained = tick + 1 >= ticks and not (a_idx.size or pend.size or queued)
        if (tick + 1) % rec_every == 0 or tick == last_tick or (drained and cfg.drain_s):
            span = (tick % rec_every + 1) * cfg.tick_s
            rec_putil[r] = np.minimum(work_done_rec / span, 1.0)
            work_done_rec[:] = 0.0
            if progress is not None:
                progress(t1)
    seconds_per_token = pc.seconds_per_token
    del side, pc  # their per-request arrays (a share keeps its own)

    # ---- accounting ----
    # whole tokens per request: the first (from prefill), all when completed, those done when
    # running; first tokens past the end (queued prefills when the simulation stops) do not count
    done_tokens = (first_token < end).astype(np.int32)
    np.copyto(done_tokens, outputs, where=status == COMPLETED)
    done_tokens[a_idx] = np.floor(a_done)
    first_hour, in_hour, hit_hour = hourly_prompts(
        first_token, end, inputs, workload.cached_tokens, hours
    )
    n_rec = -(-int(np.ceil(end / cfg.tick_s)) // rec_every)
    rec_batch, rec_kv, rec_step, rec_putil = (
        x[:n_rec] for x in (rec_batch, rec_kv, rec_step, rec_putil)
    )
    ttft = first_token
    ttft -= arrival
    # first tokens come from prefill: count them as output of the prefill hour
    out_hour += first_hour
    # real-scale integers, rounded once over the day (the hours add up to the total)
    in_hour, hit_hour, out_hour = (real_parts(x.tolist(), S) for x in (in_hour, hit_hour, out_hour))
    p_sec_h = np.zeros(hours)
    d_sec_h = np.zeros(hours)
    hourly = []
    for h in range(hours):
        p_s, d_s = schedule.node_seconds(h * 3600.0, min((h + 1) * 3600.0, duration))
        p_sec_h[h], d_sec_h[h] = p_s, d_s
        span = min((h + 1) * 3600.0, duration) - h * 3600.0
        cost = fleet_cost_usd(
            (p_s + d_s) / 3600.0, prefill.hw.gpus_per_node, prefill.hw.gpu_hour_usd
        )
        rev = revenue_usd(hit_hour[h], in_hour[h] - hit_hour[h], out_hour[h], cfg.prices)
        hourly.append(
            {
                "hour": h,
                "nodes": (p_s + d_s) / span,
                "prefill_nodes": p_s / span,
                "decode_nodes": d_s / span,
                "input_tokens": in_hour[h],
                "cache_hit_input_tokens": hit_hour[h],
                "output_tokens": out_hour[h],
                "cost_usd": cost,
                "revenue_usd": rev,
            }
        )
    p_total, d_total = p_sec_h.sum(), d_sec_h.sum()
    cost = sum(h["cost_usd"] for h in hourly)
    revenue = sum(h["revenue_usd"] for h in hourly)
    in_total, hit_total, out_total = sum(in_hour), sum(hit_hour), sum(out_hour)
    speed = tpot[np.isfinite(tpot)]
    np.reciprocal(speed, out=speed)
    nodes_curve = schedule.nodes_at(np.arange(0.0, duration, 60.0))
    totals = {
        "hours": duration / 3600.0,
        "peak_nodes": int(nodes_curve.max()),
        "avg_nodes": (p_total + d_total) / duration,
        "avg_prefill_nodes": p_total / duration,
        "avg_decode_nodes": d_total / duration,
        "cost_usd": cost,
        "input_tokens": in_total,
        "cache_hit_input_tokens": hit_total,
        "cache_hit_ratio": hit_total / max(in_total, 1),
        "output_tokens": out_total,
        "revenue_usd": revenue,
        "margin": margin(revenue, cost) if cost > 0 else float("nan"),
        # colocated: every node does both phases
        "prefill_tokens_per_s_per_node": float(
            in_total / max(d_total if colocated else p_total, 1e-9)
        ),
        "decode_tokens_per_s_per_node": float(out_total / max(d_total, 1e-9)),
        "mean_output_tokens_per_s": float(speed.mean()) if speed.size else float("nan"),
        "mean_kv_len_per_output_token": float(kv_weighted / max(decoded, 1.0)),
        "sample_scale": S,
    }
    return SimulationResult(
        scale=S,
        duration_s=duration,
        status=status,
        reason=reason,
        ttft_s=ttft,
        tpot_s=tpot,
        finish_s=finish_t,
        output_tokens=done_tokens,
        record_t_s=np.arange(n_rec) * rec_every * cfg.tick_s,
        decode_batch_per_gpu=rec_batch,
        decode_kv_usage=rec_kv,
        decode_step_s=rec_step,
        prefill_utilisation=rec_putil,
        itl_edges_s=itl_edges,
        itl_tokens=itl_tokens,
        hourly=hourly,
        totals=totals,
        refused=workload.refused,
        model={
            "name": decode.model.name,
            "kv_cache_dtype": decode.model.kv_cache_dtype,
            "kv_bytes_per_token": decode.model.kv_bytes_per_token,
            "prefill_seconds_per_token": seconds_per_token,
            "prefill_expert_imbalance": prefill.balance.imbalance,
            "decode_expert_imbalance": decode.balance.imbalance,
            "prefill_dp_imbalance": imb["prefill"],
            "decode_dp_imbalance_requests": imb["decode_requests"],
            "decode_dp_imbalance_kv": imb["decode_kv"],
            "decode_kv_capacity_tokens_per_gpu": decode.kv_capacity_tokens_per_gpu,
            **(
                {
                    "kv_bytes_per_request": decode.model.kv_bytes_per_request,
                    "decode_kv_request_overhead_tokens": decode.kv_request_overhead_tokens,
                    "assumed": list(V4_ASSUMPTIONS),
                }
                if decode.model.v4
                else {}
            ),
        },
    )
