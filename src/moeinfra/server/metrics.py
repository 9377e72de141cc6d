"""``GET /metrics``: the server's Prometheus metrics, under moeinfra's names, vLLM's, or both
(``serve up --metric-names``; default both, so a vLLM Grafana dashboard finds its series).

``moeinfra:`` names. Per request: TTFT, TPOT (mean gap after the first token) and every
inter-token gap, as histograms; prompt, generated and prefix-cache-hit tokens, finished requests by
reason. Per unit (labels ``unit``, ``role``): waiting and running requests, KV blocks used and
total, expert balancedness; KV bytes sent and received (counters). Units alive by role, requests in
flight. MTP speculative decoding (vLLM's ``spec_decode_*`` counters): verification rounds with
drafts, draft tokens, accepted draft tokens, and accepted drafts per draft position (label
``position``, 0 = the first draft). Frames dropped by socket, peers refused at the handshake.

``vllm:`` names (labels ``model_name``, ``engine``), what vLLM 0.12's ``PrometheusStatLogger``
exports and its dashboards query: ``e2e_request_latency_seconds``, ``request_queue_time_seconds``
(arrival on the prefill rank to its first step), ``request_prefill_time_seconds`` (then to the
first token), ``request_decode_time_seconds`` (first to last token),
``request_inference_time_seconds``, ``time_to_first_token_seconds``,
``inter_token_latency_seconds`` (and the older dashboards' ``time_per_output_token_seconds``),
``request_time_per_output_token_seconds``, ``request_prompt_tokens`` /
``request_generation_tokens`` / ``request_max_num_generation_tokens`` histograms,
``prompt_tokens_total``, ``generation_tokens_total``, ``request_success_total{finished_reason}``,
``num_requests_running`` / ``waiting``, ``kv_cache_usage_perc`` (and ``gpu_cache_usage_perc``),
``prefix_cache_queries_total`` / ``hits_total``, ``num_preemptions_total``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

NAME_SETS = ("both", "moeinfra", "vllm")

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0, 20.0, 40.0,
)  # fmt: skip
# vLLM's own buckets, so that its dashboards' quantiles read the same
_VLLM_TTFT = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_VLLM_ITL = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
_VLLM_REQUEST = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def _token_buckets(limit: int) -> list[float]:
    """vLLM's 1-2-5 series up to ``limit`` tokens."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


@dataclass(frozen=True)
class RequestTimes:
    """One finished request as the API saw it (seconds; ``queue_s`` from its prefill rank)."""

    finish_reason: str
    prompt_tokens: int
    generated: int
    cached: int
    max_tokens: int
    e2e_s: float
    ttft_s: float | None
    queue_s: float
    decode_s: float


class ServerMetrics:
    """The registry and the metrics the router and API update."""

    def __init__(
        self, names: str = "both", model_name: str = "model", max_model_len: int = 1 << 17
    ) -> None:
        if names not in NAME_SETS:
            raise ValueError(f"--metric-names={names!r} must be one of {', '.join(NAME_SETS)}")
        self.registry = CollectorRegistry()
        r = self.registry
        self.ours = names in ("both", "moeinfra")
        self.vllm = _VllmMetrics(r, model_name, max_model_len) if names != "moeinfra" else None
        if not self.ours:
            r = CollectorRegistry()  # moeinfra's own families are kept but not served
        self.ttft = Histogram(
            "moeinfra:time_to_first_token_seconds",
            "Seconds from request arrival to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "moeinfra:time_per_output_token_seconds",
            "Mean seconds per output token after the first, per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "moeinfra:inter_token_latency_seconds",
            "Seconds between consecutive output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "moeinfra:prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "moeinfra:generation_tokens", "Generated tokens", registry=r
        )
        self.cache_hit_tokens = Counter(
            "moeinfra:prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache (memory or disk)",
            registry=r,
        )
        self.requests = Counter(
            "moeinfra:requests", "Finished requests by reason", ["finish_reason"], registry=r
        )
        self.in_flight = Gauge("moeinfra:requests_in_flight", "Requests in flight", registry=r)
        self.units_alive = Gauge("moeinfra:units_alive", "Live units", ["role"], registry=r)
        self.unit_restarts = Counter(
            "moeinfra:unit_restarts",
            "Units that started again under their id (restarted by serve up, by hand or by the "
            "elastic agent) or rejoined after a silence or an API-server restart",
            ["role"],
            registry=r,
        )
        labels = ["unit", "role"]
        self.waiting = Gauge(
            "moeinfra:unit_waiting_requests", "Requests queued", labels, registry=r
        )
        self.running = Gauge(
            "moeinfra:unit_running_requests", "Requests running", labels, registry=r
        )
        self.kv_used = Gauge("moeinfra:kv_blocks_used", "KV blocks in use", labels, registry=r)
        self.kv_total = Gauge("moeinfra:kv_blocks_total", "KV blocks", labels, registry=r)
        self.balancedness = Gauge(
            "moeinfra:expert_balancedness",
            "mean/max expert tokens per rank over recent steps (1 = even)",
            labels,
            registry=r,
        )
        self.kv_sent = Counter(
            "moeinfra:kv_transfer_sent_bytes", "KV bytes handed off", labels, registry=r
        )
        self.kv_received = Counter(
            "moeinfra:kv_transfer_received_bytes", "KV bytes received", labels, registry=r
        )
        self.spec_drafts = Counter(
            "moeinfra:spec_decode_num_drafts",
            "Verification rounds of a request with MTP drafts",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "moeinfra:spec_decode_num_draft_tokens", "MTP draft tokens proposed", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "moeinfra:spec_decode_num_accepted_tokens", "MTP draft tokens accepted", registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "moeinfra:spec_decode_num_accepted_tokens_per_pos",
            "MTP draft tokens accepted at each draft position (0: the first draft)",
            ["position"],
            registry=r,
        )
        self.dropped_frames = Counter(
            "moeinfra:dropped_frames",
            "Frames that were not a message, dropped (socket: control = the API server's, "
            "unit = a unit rank's control or KV socket)",
            ["socket"],
            registry=r,
        )
        self.refused_peers = Counter(
            "moeinfra:refused_peers",
            "Peers that failed the control socket's CURVE handshake (no or another secret)",
            registry=r,
        )

    # ------------------------------------------------------------------ per request
    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        if self.vllm is not None:
            self.vllm.ttft.observe(ttft_s)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        if self.vllm is not None:
            self.vllm.itl.observe(seconds)
            self.vllm.tpot_legacy.observe(seconds)

    def request_finished(self, times: RequestTimes) -> None:
        self.finished(times.finish_reason)
        self.prompt_tokens.inc(times.prompt_tokens)
        self.generation_tokens.inc(times.generated)
        self.cache_hit_tokens.inc(times.cached)
        tpot = times.decode_s / (times.generated - 1) if times.generated > 1 else None
        if tpot is not None:
            self.tpot.observe(tpot)
        if self.vllm is not None:
            self.vllm.request_finished(times, tpot or 0.0)

    def finished(self, reason: str) -> None:
        self.requests.labels(reason or "unknown").inc()

    # ------------------------------------------------------------------ per unit
    def unit_state(self, unit) -> None:
        """Set a unit's gauges from its ranks' latest state reports (sums over the ranks)."""
        labels = (unit.unit_id, unit.role)
        reports = [r.report for r in unit.ranks]

        def total(key: str) -> float:
            return float(sum(getattr(r, key) for r in reports))

        self.waiting.labels(*labels).set(total("waiting"))
        self.running.labels(*labels).set(total("running"))
        self.kv_used.labels(*labels).set(total("kv_blocks_used"))
        self.kv_total.labels(*labels).set(total("kv_blocks_total"))
        balance = unit.expert_balancedness()
        if balance is not None:
            self.balancedness.labels(*labels).set(balance)

    def rank_counters(self, previous, report, unit=None) -> None:
        """Add what a rank counted between two of its state reports (each carries the rank's
        totals so far): MTP drafts and acceptances, KV bytes moved (``unit``'s), frames its
        sockets dropped, prefix-cache queries and hits, preemptions."""

        def grown(key: str) -> int:
            return max(0, getattr(report, key) - getattr(previous, key))

        for counter, key in (
            (self.spec_drafts, "spec_num_drafts"),
            (self.spec_draft_tokens, "spec_num_draft_tokens"),
            (self.spec_accepted_tokens, "spec_num_accepted_tokens"),
        ):
            if grown(key):
                counter.inc(grown(key))
        if grown("dropped_frames"):
            self.dropped_frames.labels("unit").inc(grown("dropped_frames"))
        if unit is not None:
            labels = (unit.unit_id, unit.role)
            self.kv_sent.labels(*labels).inc(grown("kv_sent_bytes"))
            self.kv_received.labels(*labels).inc(grown("kv_received_bytes"))
        before = previous.spec_accepted_per_pos
        for pos, count in enumerate(report.spec_accepted_per_pos):
            # every position appears (at 0 before any acceptance), as vLLM's do
            more = count - (before[pos] if pos < len(before) else 0)
            self.spec_accepted_per_pos.labels(str(pos)).inc(max(0, more))
        if self.vllm is not None:
            self.vllm.prefix_queries.inc(grown("prefix_queried_tokens"))
            self.vllm.prefix_hits.inc(grown("prefix_hit_tokens"))
            self.vllm.preemptions.inc(grown("preemptions"))

    def unit_gone(self, unit) -> None:
        for metric in (
            self.waiting,
            self.running,
            self.kv_used,
            self.kv_total,
            self.balancedness,
            self.kv_sent,
            self.kv_received,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(unit.unit_id, unit.role)

    # ------------------------------------------------------------------ scrape
    def refresh(self, router) -> None:
        """Gauges read from the router at scrape time."""
        self.in_flight.set(len(router.requests))
        for role in ("prefill", "decode", "colocated"):
            alive = sum(1 for u in router.units.values() if u.ready and u.role == role)
            self.units_alive.labels(role).set(alive)
        if self.vllm is not None:
            self.vllm.refresh(router)

    def render(self, router) -> bytes:
        self.refresh(router)
        return generate_latest(self.registry)


class _VllmMetrics:
    """The series vLLM's server exports, under its names and labels."""

    def __init__(self, registry, model_name: str, max_model_len: int) -> None:
        r, self.labels = registry, {"model_name": model_name, "engine": "0"}
        names = list(self.labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vllm:{name}", doc, names, buckets=buckets, registry=r).labels(
                **self.labels
            )

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"vllm:{name}", doc, names, registry=r).labels(**self.labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"vllm:{name}", doc, names, registry=r).labels(**self.labels)

        tokens = _token_buckets(max_model_len)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end latency", _VLLM_REQUEST)
        self.queue = histogram("request_queue_time_seconds", "Time waiting", _VLLM_REQUEST)
        self.prefill = histogram("request_prefill_time_seconds", "Prefill time", _VLLM_REQUEST)
        self.decode = histogram("request_decode_time_seconds", "Decode time", _VLLM_REQUEST)
        self.inference = histogram(
            "request_inference_time_seconds", "Prefill and decode time", _VLLM_REQUEST
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _VLLM_TTFT)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency", _VLLM_ITL)
        self.tpot_legacy = histogram(
            "time_per_output_token_seconds", "Inter-token latency (vLLM <= 0.10's name)", _VLLM_ITL
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "Decode time per output token", _VLLM_ITL
        )
        self.prompt_hist = histogram("request_prompt_tokens", "Prompt tokens", tokens)
        self.generation_hist = histogram("request_generation_tokens", "Generated tokens", tokens)
        self.max_tokens_hist = histogram(
            "request_max_num_generation_tokens", "max_tokens of requests", tokens
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.success = Counter(
            "vllm:request_success", "Finished requests", [*names, "finished_reason"], registry=r
        )
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found cached")
        self.preemptions = counter("num_preemptions", "Requests preempted")
        self.running = gauge("num_requests_running", "Requests running on the units")
        self.waiting = gauge("num_requests_waiting", "Requests queued on the units")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage (1 = full)")
        self.kv_usage_legacy = gauge("gpu_cache_usage_perc", "KV cache usage (older name)")

    def request_finished(self, times: RequestTimes, tpot_s: float) -> None:
        self.success.labels(**self.labels, finished_reason=times.finish_reason).inc()
        self.prompt_tokens.inc(times.prompt_tokens)
        self.generation_tokens.inc(times.generated)
        self.prompt_hist.observe(times.prompt_tokens)
        self.generation_hist.observe(times.generated)
        self.max_tokens_hist.observe(times.max_tokens)
        self.e2e.observe(times.e2e_s)
        self.tpot.observe(tpot_s)
        if times.ttft_s is None:
            return
        self.queue.observe(times.queue_s)
        prefill_s = max(0.0, times.ttft_s - times.queue_s)
        self.prefill.observe(prefill_s)
        self.decode.observe(times.decode_s)
        self.inference.observe(prefill_s + times.decode_s)

    def refresh(self, router) -> None:
        reports = [r.report for u in router.units.values() if u.alive for r in u.ranks]
        self.running.set(sum(r.running for r in reports))
        self.waiting.set(sum(r.waiting for r in reports))
        total = sum(r.kv_blocks_total for r in reports)
        used = sum(r.kv_blocks_used for r in reports)
        self.kv_usage.set(used / total if total else 0.0)
        self.kv_usage_legacy.set(used / total if total else 0.0)
