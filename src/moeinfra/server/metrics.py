"""``GET /metrics``: the server's Prometheus metrics (names in vLLM's style, ``moeinfra:`` prefix).

Per request: TTFT, TPOT (mean gap after the first token) and every inter-token gap, as histograms;
prompt, generated and prefix-cache-hit tokens, finished requests by reason. Per unit (labels
``unit``, ``role``): waiting and running requests, KV blocks used and total, expert balancedness,
KV bytes sent and received. Units alive by role, requests in flight. MTP speculative decoding
(vLLM's ``spec_decode_*`` counters): verification rounds with drafts, draft tokens, accepted draft
tokens, and accepted drafts per draft position (label ``position``, 0 = the first draft).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0, 20.0, 40.0,
)  # fmt: skip


class ServerMetrics:
    """The registry and the metrics the router and API update."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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
        self.kv_sent = Gauge(
            "moeinfra:kv_transfer_sent_bytes", "KV bytes handed off", labels, registry=r
        )
        self.kv_received = Gauge(
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

    def unit_state(self, unit) -> None:
        """Set a unit's gauges from its ranks' latest state reports (sums over the ranks)."""
        labels = (unit.unit_id, unit.role)
        reports = [r.report for r in unit.ranks if r.report]

        def total(key: str) -> float:
            return float(sum(r.get(key, 0) for r in reports))

        self.waiting.labels(*labels).set(total("waiting"))
        self.running.labels(*labels).set(total("running"))
        self.kv_used.labels(*labels).set(total("kv_blocks_used"))
        self.kv_total.labels(*labels).set(total("kv_blocks_total"))
        self.kv_sent.labels(*labels).set(total("kv_sent_bytes"))
        self.kv_received.labels(*labels).set(total("kv_received_bytes"))
        balance = unit.expert_balancedness()
        if balance is not None:
            self.balancedness.labels(*labels).set(balance)

    def spec_decode(self, previous: dict, report: dict) -> None:
        """Add what a rank drafted and had accepted between two of its state reports (each
        carries the rank's totals so far) to the ``spec_decode`` counters."""

        def grown(key: str) -> int:
            return max(0, report.get(key, 0) - previous.get(key, 0))

        for counter, key in (
            (self.spec_drafts, "spec_num_drafts"),
            (self.spec_draft_tokens, "spec_num_draft_tokens"),
            (self.spec_accepted_tokens, "spec_num_accepted_tokens"),
        ):
            if grown(key):
                counter.inc(grown(key))
        before = previous.get("spec_accepted_per_pos", ())
        for pos, count in enumerate(report.get("spec_accepted_per_pos", ())):
            # every position appears (at 0 before any acceptance), as vLLM's do
            more = count - (before[pos] if pos < len(before) else 0)
            self.spec_accepted_per_pos.labels(str(pos)).inc(max(0, more))

    def unit_gone(self, unit) -> None:
        for gauge in (
            self.waiting,
            self.running,
            self.kv_used,
            self.kv_total,
            self.balancedness,
            self.kv_sent,
            self.kv_received,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(unit.unit_id, unit.role)

    def finished(self, reason: str) -> None:
        self.requests.labels(reason or "unknown").inc()

    def refresh(self, router) -> None:
        """Gauges read from the router at scrape time."""
        self.in_flight.set(len(router.requests))
        for role in ("prefill", "decode", "colocated"):
            alive = sum(1 for u in router.units.values() if u.ready and u.role == role)
            self.units_alive.labels(role).set(alive)

    def render(self, router) -> bytes:
        self.refresh(router)
        return generate_latest(self.registry)
