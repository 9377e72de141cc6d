"""The API server's side of the units: who is alive, where each request runs, what comes back.

The router binds a ZeroMQ ``ROUTER`` socket that every unit rank connects to. It places a request
with the same balancers the simulator uses (:class:`~moeinfra.serving.balancers.
PrefillLoadBalancer` over every prefill rank, fed with the uncached prompt tokens and attention each
rank has queued; :class:`~moeinfra.serving.balancers.DecodeLoadBalancer` over every decode rank,
fed with each rank's live KV tokens and requests), sends it to its prefill rank with the decode
rank's KV address, and routes the step outputs that come back to the request's event queue.

Failures: a request whose KV hand-off the decode rank has not taken ``kv_transfer_timeout_s``
after the prefill rank's first token ends with an error naming the decode unit and its address.
A unit whose process exits (or whose ranks stop reporting for ``unit_timeout_s``) is
dropped. Its requests are retried once on other units when the client has seen none of their
tokens yet (non-streaming requests, streams before their first token), and end with an error
otherwise.

Rejoining: a rank the router does not know (the API server restarted) or whose unit it gave up
after a silence is told to :class:`~moeinfra.server.messages.Rejoin`: it ends what it holds and
says hello again. A hello of a new start of a known unit id (its ``incarnation`` differs: the
unit restarted, or another unit was given the same ``--unit-id``) replaces the old start, whose
requests fail over as if it had exited and whose ranks, if alive, are told to stop: the newest
start wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from moeinfra.engine.params import SamplingParams
from moeinfra.server.messages import (
    Abort,
    Add,
    BadFrame,
    Bye,
    Failed,
    Hello,
    Outputs,
    Received,
    Rejoin,
    Release,
    Shutdown,
    State,
    Welcome,
    decode_to_router,
    encode,
)
from moeinfra.serving.balancers import DecodeLoadBalancer, PrefillLoadBalancer, attention_cost

log = logging.getLogger(__name__)

#: Engine steps kept per rank for ``GET /calibration/steps``.
STEP_LOG = 8192
#: Seconds between two answers (Rejoin, Shutdown) to the messages of a rank the router does not
#: take: a rank reports 4 times a second.
NUDGE_EVERY_S = 1.0


class Overloaded(Exception):
    """Every queue is full: the client should retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoUnits(Exception):
    """No live unit can take the request (starting, or all units gone)."""


@dataclass(eq=False)
class RankState:
    """One rank of a unit as the router sees it (``requests``: live ones placed on it)."""

    unit: UnitState
    rank: int
    identity: bytes
    kv_address: str | None
    max_num_seqs: int
    pid: int = 0
    queued_tokens: float = 0.0
    queued_attention: float = 0.0
    kv_tokens: int = 0
    requests: set = field(default_factory=set)
    report: State = field(default_factory=State)
    info: Hello | None = None
    steps: deque = field(default_factory=lambda: deque(maxlen=STEP_LOG))
    busy_s: float = 0.0  # seconds of engine steps reported so far
    occupancy_s: float = 0.0  # running requests x seconds, from the state reports
    reported_at: float | None = None


@dataclass(eq=False)
class UnitState:
    """A unit: its role, ranks (filled in as they say hello), process when local, liveness."""

    unit_id: str
    role: str
    num_ranks: int
    ranks: list = field(default_factory=list)
    process: object = None
    last_seen: float = field(default_factory=time.monotonic)
    draining: bool = False
    alive: bool = True
    host: str = ""
    incarnation: str = ""  # the start its ranks said hello from (Hello.incarnation)
    lost: str = ""  # why the router dropped it ("stopped reporting": its ranks may come back)
    stopped: bool = False  # told to stop: its ranks' last messages are not answered

    @property
    def ready(self) -> bool:
        return self.alive and len(self.ranks) == self.num_ranks

    def expert_balancedness(self) -> float | None:
        """mean/max expert tokens per rank over the unit's recent steps, averaged over layers."""
        loads = [r.report.expert_gpu_load for r in self.ranks]
        loads = [x for x in loads if x is not None]
        if not loads:
            return None
        total = np.sum(loads, axis=0)
        peak = total.max(axis=1)
        ok = peak > 0
        return float((total.mean(axis=1)[ok] / peak[ok]).mean()) if ok.any() else None

    def work_done_s(self) -> float:
        """Unit-seconds of work done so far: the busy seconds of its steps (prefill; ranks step
        together, the slowest counts), or its slot occupancy (decode: running requests x seconds
        over its slots, a decode unit being busy as long as anything runs)."""
        if not self.ranks:
            return 0.0
        if self.role == "decode":
            slots = sum(r.max_num_seqs for r in self.ranks)
            return sum(r.occupancy_s for r in self.ranks) / max(slots, 1)
        return max(r.busy_s for r in self.ranks)

    def step_records(self) -> list[dict]:
        """The unit's recent engine steps that every rank reported, one dict per step: its
        ``phase`` (``prefill``: prompt tokens only, ``decode``: one-token rows only, else
        ``mixed``), the busiest rank's ``tokens``, ``attended_keys`` and ``sampled`` rows (it paces
        the step: ranks meet in every layer's all-to-all), the slowest rank's ``seconds`` and when
        the last rank ``ended`` it (Unix time)."""
        if not self.ranks:
            return []
        by_rank = [{row[0]: row[1:] for row in r.steps} for r in self.ranks]
        common = set(by_rank[0]).intersection(*by_rank[1:])
        records = []
        for step in sorted(common):
            rows = [ranks[step] for ranks in by_rank]
            prefill = max(r[0] for r in rows)
            decode = max(r[1] for r in rows)
            if prefill + decode == 0:
                continue
            phase = "mixed" if prefill and decode else "prefill" if prefill else "decode"
            # the rank that paces the step: most attention work in prefill (it grows with the
            # square of a prompt), most rows in decode
            busiest = max(rows, key=lambda r: (r[2], r[0]) if phase == "prefill" else (r[1], r[2]))
            records.append(
                {
                    "step": step,
                    "phase": phase,
                    "tokens": busiest[0] + busiest[1],
                    "attended_keys": busiest[2],
                    "sampled": busiest[3],
                    "seconds": max(r[4] for r in rows),
                    "ended": max(r[5] for r in rows),
                }
            )
        return records


RETRY_MARK = "~retry"


def _replaced(unit_id: str) -> str:
    """Why a rank of a unit's start that a newer start replaced is told to stop."""
    return (
        f"unit {unit_id} was started again elsewhere; this start stops (give each unit its own "
        "--unit-id)"
    )


def _api_request_id(unit_request_id: str) -> str:
    return unit_request_id.split(RETRY_MARK, 1)[0]


@dataclass(eq=False)
class Tracked:
    """A request in flight. ``events`` (may be shared by the choices of one API call) gets its
    step outputs, ``("error", request_id, message)`` and ``("restart", request_id)`` (retried
    elsewhere from scratch: forget what arrived so far)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cached_estimate: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    prefill: RankState | None = None
    decode: RankState | None = None
    phase: str = "prefill"
    streamed: bool = False  # the client has seen some of its output
    retries: int = 0
    arrival_s: float = field(default_factory=time.monotonic)
    generated: int = 0
    early: list = field(default_factory=list)  # decode outputs that overtook the first token
    received: bool = False  # the decode rank took the KV hand-off
    handoff_deadline: float | None = None  # when a hand-off not taken by then fails the request

    @property
    def uncached(self) -> int:
        return len(self.prompt_ids) - self.cached_estimate

    @property
    def unit_request_id(self) -> str:
        """The id the units know this attempt by: a retry gets a new one, so an output of the
        attempt it replaces that was already on its way is not taken for the retry's."""
        return (
            self.request_id if not self.retries else f"{self.request_id}{RETRY_MARK}{self.retries}"
        )


class Router:
    """Units, placement and message routing (runs on the API server's event loop)."""

    def __init__(
        self,
        control_address: str,
        model_digest: str,
        *,
        max_queue: int = 64,
        unit_timeout_s: float = 10.0,
        kv_transfer_timeout_s: float = 30.0,
        metrics=None,
        drafting: bool | None = None,
        keys=None,
    ) -> None:
        self.control_address = control_address
        self.keys = keys  # CurveKeys of --secret-file: peers must hold the secret
        self.model_digest = model_digest
        # units must agree on the KV layout a hand-off carries: with the MTP layer's (drafting)
        # or without; None: whatever the first unit does
        self.drafting = drafting
        self.max_queue = max_queue
        self.unit_timeout_s = unit_timeout_s
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.metrics = metrics
        self.units: dict[str, UnitState] = {}
        self.requests: dict[str, Tracked] = {}
        self.accepting = True
        self.notes: deque[str] = deque(maxlen=100)
        self.dropped_frames = 0  # frames on the control socket that were not a message
        self.retired: set[tuple[str, str]] = set()  # (unit, incarnation) a newer start replaced
        self._nudged: dict[bytes, float] = {}  # identity -> when it was last told to rejoin/stop
        self.refused_peers = 0  # peers that failed the CURVE handshake
        self._tasks: list[asyncio.Task] = []
        self.socket = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._auth = None
        self.socket = self._ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self.keys is not None:
            from moeinfra.server.secret import authenticator, serve_securely

            self._auth = authenticator(self._ctx, self.keys, asyncio=True)
            serve_securely(self.socket, self.keys)
        if self.control_address.endswith(":0"):
            host = self.control_address.rsplit(":", 1)[0]
            port = self.socket.bind_to_random_port(host)
            self.control_address = f"{host}:{port}"
        else:
            self.socket.bind(self.control_address)
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._watch_loop()),
        ]
        if self.keys is not None:
            self._tasks.append(asyncio.create_task(self._watch_handshakes()))

    def expect_unit(self, unit_id: str, role: str, ranks: int, process=None) -> UnitState:
        """Register a unit before its ranks say hello (local units: with their process). A unit
        of the same id that is still alive is replaced as :meth:`_hello` replaces an old start."""
        old = self.units.get(unit_id)
        if old is not None and old.alive:
            self._retire(old, "was started again")
        unit = UnitState(unit_id, role, ranks, process=process)
        self.units[unit_id] = unit
        return unit

    async def wait_ready(self, timeout_s: float) -> None:
        """Until every expected unit has all its ranks; raises naming a unit that died or is late."""
        deadline = time.monotonic() + timeout_s
        while True:
            dead = [u.unit_id for u in self.units.values() if not u.alive]
            if dead:
                raise RuntimeError(f"unit {dead[0]} exited while starting (see its log above)")
            if all(u.ready for u in self.units.values()):
                return
            if time.monotonic() > deadline:
                late = next(u.unit_id for u in self.units.values() if not u.ready)
                raise RuntimeError(f"unit {late} did not start within {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def shutdown(self, wait_s: float = 15.0) -> None:
        """Stop admitting, end what is left with an error, stop every unit, close the socket."""
        self.accepting = False
        for tracked in list(self.requests.values()):
            self._fail(tracked, "server shutting down")
        for unit in self.units.values():
            self._stop_unit(unit)
        deadline = time.monotonic() + wait_s
        for unit in self.units.values():
            proc = unit.process
            if proc is None:
                continue
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.socket is not None:
            if self._auth is not None:
                self._auth.stop()
            self.socket.close(linger=0)
            self._ctx.term()
            self.socket = None

    def _stop_unit(self, unit: UnitState, reason: str = "") -> None:
        unit.stopped = True
        for rank in unit.ranks:
            self._send(rank, Shutdown(reason))

    # ------------------------------------------------------------------ placement
    def live_units(self, roles: tuple[str, ...]) -> list[UnitState]:
        return [u for u in self.units.values() if u.ready and not u.draining and u.role in roles]

    def kv_tokens_per_rank(self) -> int | None:
        """The smallest KV cache (tokens) of any live unit's rank, as the ranks reported it in
        their hellos (None: no unit yet)."""
        sizes = [
            r.info.num_kv_blocks * r.info.block_size
            for u in self.live_units(("prefill", "decode", "colocated"))
            for r in u.ranks
            if r.info is not None and r.info.num_kv_blocks
        ]
        return min(sizes, default=None)

    def capacity(self) -> int:
        """Requests the system holds before refusing: decode slots plus the admission queue."""
        decoders = self.live_units(("decode", "colocated"))
        return sum(r.max_num_seqs for u in decoders for r in u.ranks) + self.max_queue

    def submit(self, tracked: Tracked) -> None:
        """Place and send a request; raises :class:`NoUnits` or :class:`Overloaded`."""
        if not self.accepting:
            raise Overloaded("server is shutting down", retry_after_s=5)
        if len(self.requests) >= self.capacity():
            raise Overloaded(
                f"{len(self.requests)} requests in flight, the limit is {self.capacity()}"
            )
        self._place(tracked)
        self.requests[tracked.request_id] = tracked

    def _place(self, tracked: Tracked) -> None:
        prefill_ranks = [r for u in self.live_units(("prefill", "colocated")) for r in u.ranks]
        if not prefill_ranks:
            raise NoUnits("no prefill unit is up")
        attention = np.array([r.queued_attention for r in prefill_ranks])
        tokens = np.array([r.queued_tokens for r in prefill_ranks])
        n, cached = len(tracked.prompt_ids), tracked.cached_estimate
        chosen = PrefillLoadBalancer(len(prefill_ranks), max_piece_tokens=1 << 40).assign(
            [n], [cached], rank_attention=attention, rank_tokens=tokens
        )
        prefill = prefill_ranks[int(chosen.rank[0])]
        if prefill.unit.role == "colocated":
            decode = prefill
        else:
            decode_ranks = [r for u in self.live_units(("decode",)) for r in u.ranks]
            if not decode_ranks:
                raise NoUnits("no decode unit is up")
            kv = np.array([r.kv_tokens for r in decode_ranks], dtype=np.float64)
            count = np.array([len(r.requests) for r in decode_ranks], dtype=np.float64)
            pick = DecodeLoadBalancer(len(decode_ranks)).assign_decode([n + 1], kv, count)
            decode = decode_ranks[int(pick[0])]
        tracked.prefill, tracked.decode, tracked.phase = prefill, decode, "prefill"
        tracked.early, tracked.received, tracked.handoff_deadline = [], False, None
        prefill.queued_tokens += tracked.uncached
        prefill.queued_attention += float(attention_cost(tracked.uncached, cached))
        prefill.requests.add(tracked.request_id)
        decode.requests.add(tracked.request_id)
        decode.kv_tokens += n + 1
        handoff = None if decode is prefill else decode.kv_address
        self._send(
            prefill, Add(tracked.unit_request_id, tracked.prompt_ids, tracked.params, handoff)
        )

    def _release_prefill(self, tracked: Tracked) -> None:
        rank = tracked.prefill
        if rank is not None and tracked.phase == "prefill":
            rank.queued_tokens = max(0.0, rank.queued_tokens - tracked.uncached)
            rank.queued_attention = max(
                0.0,
                rank.queued_attention
                - float(attention_cost(tracked.uncached, tracked.cached_estimate)),
            )
            if rank is not tracked.decode:
                rank.requests.discard(tracked.request_id)
                if not tracked.received:
                    tracked.handoff_deadline = time.monotonic() + self.kv_transfer_timeout_s
            tracked.phase = "decode"

    def _release(self, tracked: Tracked) -> None:
        self._release_prefill(tracked)
        for rank in (tracked.prefill, tracked.decode):
            if rank is not None:
                rank.requests.discard(tracked.request_id)
        if tracked.decode is not None:
            used = len(tracked.prompt_ids) + 1 + tracked.generated
            tracked.decode.kv_tokens = max(0, tracked.decode.kv_tokens - used)
        self.requests.pop(tracked.request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (a client went away)."""
        tracked = self.requests.get(request_id)
        if tracked is not None:
            self._stop(tracked, "abort")

    def _fail(self, tracked: Tracked, message: str) -> None:
        self._stop(tracked, "error")
        tracked.events.put_nowait(("error", tracked.request_id, message))

    def _stop(self, tracked: Tracked, reason: str) -> None:
        for rank in {tracked.prefill, tracked.decode} - {None}:
            self._send(rank, Abort(tracked.unit_request_id))
        self._release(tracked)
        if self.metrics is not None:
            self.metrics.finished(reason)

    # ------------------------------------------------------------------ messages
    def _send(self, rank: RankState, message) -> None:
        self._send_to(rank.identity, message)

    def _send_to(self, identity: bytes, message) -> None:
        if self.socket is None:
            return
        import zmq

        with contextlib.suppress(zmq.ZMQError):
            self.socket.send_multipart([identity, encode(message)], flags=zmq.NOBLOCK)

    def _rank_of(self, identity: bytes) -> RankState | None:
        """The rank whose socket identity (``unit/rank/incarnation``) this is."""
        unit = self.units.get(identity.decode(errors="replace").rsplit("/", 2)[0])
        if unit is None:
            return None
        return next((r for r in unit.ranks if r.identity == identity), None)

    def _nudge(self, identity: bytes) -> None:
        """Answer a message from a rank the router does not take: a rank of a start that a newer
        one replaced is told to stop; one it does not know (this server is new) or whose unit
        went silent and was given up is told to rejoin. Once a second at most per rank."""
        now = time.monotonic()
        if not self.accepting or now - self._nudged.get(identity, -NUDGE_EVERY_S) < NUDGE_EVERY_S:
            return
        self._nudged[identity] = now
        if len(self._nudged) > 4096:  # identities of ranks long gone
            self._nudged = {k: t for k, t in self._nudged.items() if now - t < 60.0}
        parts = identity.decode(errors="replace").rsplit("/", 2)  # unit/rank/incarnation
        unit_id, incarnation = parts[0], parts[-1]
        replaced = (unit_id, incarnation) in self.retired
        self._send_to(identity, Shutdown(_replaced(unit_id)) if replaced else Rejoin())

    async def _receive_loop(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            try:
                if len(frames) != 2:
                    raise BadFrame(f"{len(frames)} frames, a message has one")
                identity, raw = frames
                message = decode_to_router(raw)
            except BadFrame as err:
                self.drop_frame("control", frames[0], err)
                continue
            try:
                self._on_message(identity, message)
            except Exception as err:  # a bad message must not stop the server
                self.notes.append(f"{type(message).__name__} from {identity!r}: {err!r}")

    async def _watch_handshakes(self) -> None:
        """Count (and log once) peers that failed the CURVE handshake: no or another secret."""
        from zmq.utils.monitor import parse_monitor_message

        from moeinfra.server.secret import handshake_failures

        monitor = self.socket.get_monitor_socket()
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if not handshake_failures(event["event"]):
                    continue
                if self.metrics is not None:
                    self.metrics.refused_peers.inc()
                self.refused_peers += 1
                if self.refused_peers == 1:
                    log.warning(
                        "a peer at %s failed the handshake on the control socket (no or another "
                        "--secret-file); further ones are counted in moeinfra:refused_peers_total",
                        event.get("endpoint", b"?").decode(errors="replace"),
                    )
        finally:
            with contextlib.suppress(Exception):
                self.socket.disable_monitor()
            monitor.close(linger=0)

    def drop_frame(self, socket: str, peer: bytes, err: Exception) -> None:
        """Count a frame that was not a message; log the first one."""
        if self.metrics is not None:
            self.metrics.dropped_frames.labels(socket).inc()
        self.dropped_frames += 1
        if self.dropped_frames == 1:
            log.warning(
                "dropped a frame on the %s socket from %r that is not a message (%s); further "
                "ones are counted in moeinfra:dropped_frames_total",
                socket,
                peer,
                err,
            )

    def _on_message(self, identity: bytes, message) -> None:
        if isinstance(message, Hello):
            self._hello(identity, message)
            return
        rank = self._rank_of(identity)
        if rank is None or not rank.unit.alive:
            unit = None if rank is None else rank.unit
            forgotten = unit is None or (unit.lost == "stopped reporting" and not unit.stopped)
            if forgotten and not isinstance(message, Bye):
                self._nudge(identity)
            if unit is not None and isinstance(message, Bye):
                unit.alive = False
            return
        rank.unit.last_seen = time.monotonic()
        if isinstance(message, Outputs):
            for out in message.outputs:
                self._output(rank, out)
        elif isinstance(message, State):
            previous, rank.report = rank.report, message
            steps, message.steps = message.steps, []
            rank.steps.extend(steps)
            rank.busy_s += sum(row[5] for row in steps)
            now = time.monotonic()
            if rank.reported_at is not None:
                rank.occupancy_s += message.running * (now - rank.reported_at)
            rank.reported_at = now
            if self.metrics is not None:
                self.metrics.unit_state(rank.unit)
                self.metrics.rank_counters(previous, message, rank.unit)
        elif isinstance(message, Received):
            tracked = self._current(message.request_id)
            if tracked is not None and rank is tracked.decode:
                tracked.received, tracked.handoff_deadline = True, None
                if tracked.prefill is not None and tracked.prefill is not rank:
                    # (blocks lent to a connector that reads them remotely may go)
                    self._send(tracked.prefill, Release(message.request_id))
        elif isinstance(message, Failed):
            tracked = self._current(message.request_id)
            if tracked is not None:
                self._fail(tracked, message.message)
        elif isinstance(message, Bye):
            # a unit stopping on its own (a failing rank) loses its requests
            if rank.unit.alive and not rank.unit.draining and self.accepting:
                self.unit_lost(rank.unit, "stopped")
            rank.unit.alive = False

    def _hello(self, identity: bytes, info: Hello) -> None:
        known = self.units.get(info.unit)
        if (info.unit, info.incarnation) in self.retired:
            self._send_to(identity, Shutdown(_replaced(info.unit)))
            return
        refused = self._refusal(info)
        if refused is not None:
            self.notes.append(f"unit {info.unit} {refused}; told to stop")
            if known is None or not known.alive:
                self.expect_unit(info.unit, info.role, info.ranks).alive = False
            self._send_to(
                identity, Shutdown(f"the API server refused unit {info.unit}: it {refused}")
            )
            return
        if known is None:  # a unit started elsewhere joins
            unit = self.expect_unit(info.unit, info.role, info.ranks)
        elif not known.alive or (known.incarnation and known.incarnation != info.incarnation):
            unit = self._new_start(known, info)
        else:
            unit = known
        unit.incarnation = unit.incarnation or info.incarnation
        unit.ranks = [r for r in unit.ranks if r.rank != info.rank]
        rank = RankState(
            unit, info.rank, identity, info.kv_address, info.max_num_seqs, info.pid, info=info
        )
        unit.ranks.append(rank)
        unit.ranks.sort(key=lambda r: r.rank)
        # a unit's ranks may span hosts (serve unit --node-rank): name each host once
        unit.host = ",".join(dict.fromkeys(r.info.host for r in unit.ranks if r.info))
        unit.last_seen = time.monotonic()
        self._nudged.pop(identity, None)
        self._send(rank, Welcome())
        if unit.ready:
            self.notes.append(f"unit {unit.unit_id} ({unit.role}) up on {unit.host}")

    def _new_start(self, known: UnitState, info: Hello) -> UnitState:
        """The state of a unit id that says hello again: a lost unit coming back, or a new start
        (restarted, or a second unit under the same id) replacing a live one."""
        if known.alive:
            self._retire(known, f"was started again ({info.host}, pid {info.pid})")
        elif known.incarnation and known.incarnation != info.incarnation:
            self.retired.add((known.unit_id, known.incarnation))
        unit = UnitState(info.unit, info.role, info.ranks, process=known.process)
        self.units[info.unit] = unit
        if self.metrics is not None:
            self.metrics.unit_restarts.labels(info.role).inc()
        self.notes.append(
            f"unit {info.unit} ({info.role}) "
            + ("rejoins" if known.incarnation == info.incarnation else "started again")
        )
        return unit

    def _retire(self, unit: UnitState, why: str) -> None:
        """Replace a live start of a unit id by a newer one: its requests fail over, and its
        ranks, if they still run, are told to stop."""
        self.unit_lost(unit, why)
        if unit.incarnation:
            self.retired.add((unit.unit_id, unit.incarnation))
        self._stop_unit(unit, _replaced(unit.unit_id))

    def _refusal(self, info: Hello) -> str | None:
        """Why a rank's unit cannot join (another model, another drafting), or None."""
        drafting = info.num_speculative_tokens > 0
        if info.model != self.model_digest:
            return "serves another model"
        if self.drafting is None:
            self.drafting = drafting
        elif drafting != self.drafting:
            # its KV would lack (or carry) the MTP layer's rows the other units hand off
            return (
                "drafts with the MTP layer, the server's units do not (--speculative-tokens)"
                if drafting
                else "does not draft with the MTP layer, the server's units do "
                "(--speculative-tokens)"
            )
        return None

    def _current(self, unit_request_id: str) -> Tracked | None:
        """The request whose current attempt the units know by this id."""
        tracked = self.requests.get(_api_request_id(unit_request_id))
        if tracked is None or tracked.unit_request_id != unit_request_id:
            return None
        return tracked

    def _output(self, rank: RankState, out) -> None:
        tracked = self._current(out.request_id)
        if tracked is None or rank not in (tracked.prefill, tracked.decode):
            if not out.finished:  # output of a request (or attempt) we no longer track: stop it
                self._send(rank, Abort(out.request_id))
            return
        out.request_id = tracked.request_id
        if rank is not tracked.prefill and tracked.phase == "prefill":
            # The prefill and decode ranks send on their own connections: the decode rank's
            # tokens can arrive before the prefill rank's first token. Hold them until it does.
            tracked.early.append(out)
            return
        self._deliver(rank, tracked, out)
        if tracked.early and tracked.phase == "decode":
            early, tracked.early = tracked.early, []
            for held in early:
                self._deliver(tracked.decode, tracked, held)

    def _deliver(self, rank: RankState, tracked: Tracked, out) -> None:
        if rank is tracked.prefill and tracked.phase == "prefill" and out.new_token_ids:
            self._release_prefill(tracked)
        if out.new_token_ids:
            tracked.generated += len(out.new_token_ids)
            if tracked.decode is not None:
                tracked.decode.kv_tokens += len(out.new_token_ids)
        if out.finished:
            self._release(tracked)
        tracked.events.put_nowait(out)

    # ------------------------------------------------------------------ failures
    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            for tracked in [t for t in self.requests.values() if t.handoff_deadline]:
                if now > tracked.handoff_deadline:
                    unit = tracked.decode.unit
                    self._fail(
                        tracked,
                        f"the KV hand-off of its prompt to decode unit {unit.unit_id} "
                        f"({tracked.decode.kv_address} on {unit.host}) did not complete within "
                        f"{self.kv_transfer_timeout_s:g} s (--kv-transfer-timeout)",
                    )
            for unit in list(self.units.values()):
                if not unit.alive:
                    continue
                exited = unit.process is not None and unit.process.poll() is not None
                silent = unit.ready and now - unit.last_seen > self.unit_timeout_s
                if exited or silent:
                    self.unit_lost(unit, "exited" if exited else "stopped reporting")
                elif unit.draining and unit.ready and not any(r.requests for r in unit.ranks):
                    self._stop_unit(unit)
                    unit.alive = False
                    self.notes.append(f"unit {unit.unit_id} ({unit.role}) drained and stopped")
                    if self.metrics is not None:
                        self.metrics.unit_gone(unit)

    def unit_lost(self, unit: UnitState, why: str) -> None:
        """Drop a unit; retry or fail the requests it held."""
        unit.alive = False
        unit.lost = why
        self.notes.append(f"unit {unit.unit_id} ({unit.role}) {why}")
        if self.metrics is not None:
            self.metrics.unit_gone(unit)
        ranks = set(unit.ranks)
        for tracked in list(self.requests.values()):
            if tracked.prefill not in ranks and tracked.decode not in ranks:
                continue
            if not tracked.streamed and tracked.retries < 1:
                for rank in {tracked.prefill, tracked.decode} - ranks - {None}:
                    self._send(rank, Abort(tracked.unit_request_id))
                self._release(tracked)
                tracked.retries += 1
                tracked.generated = 0
                tracked.events.put_nowait(("restart", tracked.request_id))
                try:
                    self.submit(tracked)
                    continue
                except (Overloaded, NoUnits) as err:
                    tracked.events.put_nowait(
                        ("error", tracked.request_id, f"unit {unit.unit_id} {why}; {err}")
                    )
                    continue
            self._fail(tracked, f"unit {unit.unit_id} ({unit.role}) {why} while serving it")

    def drain(self, unit_id: str) -> None:
        """Take no new requests on a unit; it stops once its requests finish."""
        self.units[unit_id].draining = True
