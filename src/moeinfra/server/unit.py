"""A serving unit: ``ranks`` engine ranks on ``torch.distributed`` (data-parallel attention,
expert-parallel MoE) that take requests from the API server over ZeroMQ.

Roles: ``prefill`` (compute the prompt and first token, hand the KV to a decode rank, read and
write the on-disk prefix cache), ``decode`` (receive hand-offs, generate the rest), ``colocated``
(both, no hand-off). Each rank connects a ``DEALER`` socket to the server's control address (its
identity ``<unit>/<rank>/<incarnation>``: the start its ranks agreed on), says hello, then runs
the engine loop (:func:`~moeinfra.engine.worker.serve_loop`): requests and aborts come in, step
outputs, hand-off notices and a state report (queues, KV blocks, expert balancedness, MTP drafts)
every ``REPORT_S`` go out. A decode rank also binds a ``PULL`` socket that prefill ranks push KV
to. The reports are the unit's heartbeat: an API server that does not know the rank (it restarted)
answers one with ``Rejoin``, and the rank ends what it holds and says hello again.

:func:`run_unit` is what ``moeinfra serve unit`` runs: the ranks under torch's elastic agent
(what ``torchrun`` runs: a c10d rendezvous, on this host or across the unit's hosts). A rank that
dies takes its whole unit down (its peers would block in the next all-to-all): the agent stops
every rank, on every host of the unit, and starts them all again (``max_restarts`` times), and
the new start says hello under the same unit id; the API server fails over what the old start
held. A one-rank unit without restarts runs its rank in the process itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from moeinfra.errors import InputError

ROLES = ("prefill", "decode", "colocated")
REPORT_S = 0.25
#: seconds a rank waits for the API server to answer its hello before it says so on stderr
WELCOME_WAIT_S = 10.0
#: the longest an idle rank waits for messages while a prefix read from disk is under way
READ_POLL_S = 0.001


@dataclass(frozen=True)
class UnitSpec:
    """What every rank of a unit needs to start (picklable)."""

    unit_id: str
    role: str
    ranks: int
    server: str  # the API server's control address, tcp://host:port
    model_dir: str
    engine: object  # EngineConfig
    kv_host: str = "127.0.0.1"  # address decode ranks bind their KV socket on
    kv_connector: str = "zmq"  # how KV blocks move (moeinfra.server.kv_connector.CONNECTORS)
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 1 << 30
    comm_delay_s: float = 0.0
    collective_timeout_s: float = 120.0
    noop_model: bool = False
    # a unit spanning hosts: this host runs local_ranks of them and all hosts meet at rendezvous
    # (tcp://HOST:PORT, the c10d store that node_rank 0 hosts; the rendezvous numbers the ranks
    # in the order the hosts arrive); None: all ranks here
    node_rank: int = 0
    local_ranks: int | None = None
    rendezvous: str | None = None
    threads: int | None = None  # CPU threads per rank (None: threads_per_rank's choice)
    secret_file: str | None = None  # the shared secret's file: CURVE on every socket
    max_restarts: int = 0  # times the elastic agent starts the unit's ranks again after a failure


def threads_per_rank(ranks_here: int) -> int:
    """CPU threads each of ``ranks_here`` ranks of this host runs its kernels on:
    ``OMP_NUM_THREADS`` when set (as torchrun), else the cores this process may use shared evenly
    (at least one). One rank alone on a 2-core machine gets both: with one thread its prefill
    steps took 1.7x as long (2,048 tokens, 210 vs 125 ms)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, usable_cores() // max(ranks_here, 1))


def usable_cores() -> int:
    """The cores this process may run on (its affinity: ``taskset``, a container's cpuset)."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return len(usable) if usable is not None else os.cpu_count() or 1


def address_toward(server: str) -> str:
    """This host's address on its route to ``server`` (``tcp://HOST:PORT``): what a decode rank
    binds and advertises for KV when not told (``127.0.0.1`` when the server is on loopback)."""
    import socket

    host, _, port = server.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    try:
        family = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))  # a UDP connect sends nothing: the kernel routes
            return probe.getsockname()[0]
    except (OSError, ValueError) as err:
        raise InputError(
            f"--server={server}: no route to it from this host ({err}); give --kv-host"
        ) from None


def config_digest(model_dir: str | Path) -> str:
    """Digest of a checkpoint's ``config.json``: units join a server only for the same model."""
    import hashlib

    return hashlib.blake2b(
        (Path(model_dir) / "config.json").read_bytes(), digest_size=8
    ).hexdigest()


def check_drafting(model_dir: str | Path, num_speculative_tokens: int) -> None:
    """Refuse ``--speculative-tokens`` above 0 for a checkpoint without an MTP layer (before any
    process starts): a :class:`~moeinfra.errors.CheckpointError` naming the field."""
    if not num_speculative_tokens:
        return
    from moeinfra.engine.hf_config import read_config
    from moeinfra.engine.registry import architecture, require_mtp

    source = str(Path(model_dir) / "config.json")
    raw = read_config(Path(model_dir))
    arch = architecture(raw["model_type"], source)
    option = f"--speculative-tokens={num_speculative_tokens}"
    require_mtp(arch, arch.parse_config(raw, source), source, option)


def _disk_cache(spec: UnitSpec, core):
    if spec.disk_cache_dir is None or spec.role == "decode":
        return None
    from moeinfra.server.disk_cache import DiskKVCache, model_fingerprint

    data = core.cache.data
    fingerprint = model_fingerprint(
        spec.model_dir,
        data.dtype,
        core.config.block_size,
        (data.shape[0], data.shape[2]),
    )
    return DiskKVCache(
        spec.disk_cache_dir,
        fingerprint,
        core.config.block_size,
        data.shape[0],
        data.shape[2],
        data.dtype,
        spec.disk_cache_bytes,
        reuse_last_block=core.mtp is None,
    )


def expert_gpu_load(core):
    """``[moe layers, ranks]`` tokens this rank sent to each rank's expert slots over its recent
    steps (the window the engine keeps for EPLB), or None before any step. Summed over a unit's
    ranks it gives the unit's expert balancedness."""
    import numpy as np

    from moeinfra.eplb.plan import gpu_loads

    load = core.window_load()
    if load is None:
        return None
    load = load.astype(np.float64)
    plan = core.plan
    return gpu_loads(load, plan.phy2log, plan.logcnt, plan.layout.num_gpus)


class NoopModel:
    """A unit's model with the forward and LM head replaced by zeros (``--noop-model``): what the
    serving stack around the engine sustains on its own. Benchmarks only."""

    def __init__(self, model, config) -> None:
        self._model, self._config = model, config

    def __call__(self, input_ids, segments, cache, overlap):
        import torch

        return torch.zeros(input_ids.numel(), self._config.block.hidden_size)

    def logits(self, hidden):
        import torch

        return torch.zeros(hidden.shape[0], self._config.vocab_size)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class RankServer:
    """One rank's sockets and the glue between them and the engine loop."""

    def __init__(self, spec: UnitSpec, rank: int, core, incarnation: str = "") -> None:
        import zmq

        from moeinfra.server.secret import authenticator, connect_securely, read_secret

        self.spec, self.rank, self.core = spec, rank, core
        self.incarnation = incarnation
        self.ctx = zmq.Context()
        self.keys = read_secret(spec.secret_file) if spec.secret_file else None
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.setsockopt(zmq.IDENTITY, f"{spec.unit_id}/{rank}/{incarnation}".encode())
        self.control.setsockopt(zmq.LINGER, 2000)
        if self.keys is not None:
            connect_securely(self.control, self.keys)
        self.control.connect(spec.server)
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.kv_in = None
        self.kv_address = None
        self.auth = None
        if spec.role == "decode":
            self.kv_in = self.ctx.socket(zmq.PULL)
            if self.keys is not None:
                from moeinfra.server.secret import serve_securely

                self.auth = authenticator(self.ctx, self.keys)
                serve_securely(self.kv_in, self.keys)
            port = self.kv_in.bind_to_random_port(f"tcp://{spec.kv_host}")
            self.kv_address = f"tcp://{spec.kv_host}:{port}"
            self.poller.register(self.kv_in, zmq.POLLIN)
        self.kv_out: dict[str, object] = {}  # (the sender thread's sockets)
        self.connector = None
        if spec.role != "colocated":
            from moeinfra.server.kv_connector import make_connector

            self.connector = make_connector(spec.kv_connector, spec.kv_host)
        # blocks a decode rank reads from the prefill rank itself run on a thread of their own:
        # request id -> (the read, its header)
        reads = spec.role == "decode" and self.connector.reads
        self.fetcher = ThreadPoolExecutor(1) if reads else None
        self.fetching: dict[str, tuple[Future, object]] = {}
        # hand-offs are framed, check-summed and queued on a thread of their own: the next
        # step does not wait for the previous one's (its KV was copied out of the cache)
        self.sender = ThreadPoolExecutor(1)
        self.send_failures: list[tuple[str, str]] = []  # (request id, why), from the sender
        self.disk = _disk_cache(spec, core)
        if self.disk is not None:
            core.ended_at_prefill = []
        self.writer = ThreadPoolExecutor(1) if self.disk is not None else None
        # prefix reads from disk run off the rank's loop (a shared file system can take
        # milliseconds a block): request id -> (the read, the "add" waiting for it)
        self.reader = ThreadPoolExecutor(1) if self.disk is not None else None
        self.reading: dict[str, tuple[Future, tuple]] = {}
        self.pending_writes = 0
        self.sent_bytes = self.received_bytes = 0
        self.handoffs_sent = 0
        self.dropped_frames = 0
        self.last_report = 0.0
        self.hello_at = time.monotonic()
        self.welcomed = self.warned = False
        self.refused = ""  # why the API server told this unit to stop, if it refused it
        self.iteration_began = time.perf_counter()
        self.stepped = core.steps
        # (step, seconds from the messages' arrival to the step's outputs sent, wall-clock end):
        # what a request waits per step, the engine's step plus the loop around it (agreement, I/O)
        self.step_seconds: list[tuple[int, float, float]] = []

    def hello(self) -> None:
        from moeinfra.server.messages import Hello

        core = self.core
        self._send(
            Hello(
                unit=self.spec.unit_id,
                rank=self.rank,
                ranks=self.spec.ranks,
                role=self.spec.role,
                model=config_digest(self.spec.model_dir),
                max_num_seqs=core.config.max_num_seqs,
                kv_address=self.kv_address,
                pid=os.getpid(),
                host=os.uname().nodename,
                num_kv_blocks=core.cache.num_blocks,
                block_size=core.config.block_size,
                max_num_batched_tokens=core.config.max_num_batched_tokens,
                redundant_experts=core.config.redundant_experts,
                num_speculative_tokens=core.num_speculative_tokens,
                dtype=str(core.dtype).removeprefix("torch."),
                device=str(core.device),
                incarnation=self.incarnation,
                kv_connector=self.connector.name if self.connector is not None else "",
            )
        )
        self.hello_at = time.monotonic()

    def _send(self, message, droppable: bool = False) -> None:
        """Send to the API server. While it is away its messages queue (up to ZeroMQ's
        high-water mark) for the next one; a ``droppable`` report that finds the queue full is
        dropped instead of stopping the rank until a server comes."""
        import zmq

        from moeinfra.server.messages import encode

        with contextlib.suppress(zmq.Again):
            self.control.send(encode(message), flags=zmq.NOBLOCK if droppable else 0)

    def rejoin(self) -> None:
        """The API server does not know this rank: end every request it holds (their clients
        were the server's that forgot them) and say hello again."""
        for request_id in list(self.core.requests):
            self.core.abort(request_id)
        self.reading.clear()
        self.fetching.clear()
        self.welcomed = self.warned = False
        self.hello()

    # ------------------------------------------------------------------ engine loop hooks
    def receive(self, timeout: float | None) -> list[tuple]:
        import zmq

        messages = []
        # a request whose blocks are being read waits at most a millisecond
        if (self.reading or self.fetching) and timeout is not None:
            timeout = min(timeout, READ_POLL_S)
        events = dict(self.poller.poll(0 if timeout is None else timeout * 1000))
        messages += self._read_from_disk()
        messages += self._fetched()
        while events:
            if self.control in events:
                while True:
                    try:
                        message = self._control_message(self.control.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if message is not None:
                        messages.append(message)
            if self.kv_in is not None and self.kv_in in events:
                while True:
                    try:
                        messages.append(("kv", self.kv_in.recv_multipart(zmq.NOBLOCK, copy=False)))
                    except zmq.Again:
                        break
            events = dict(self.poller.poll(0))
        self.iteration_began = time.perf_counter()
        return messages

    def _read_from_disk(self) -> list[tuple]:
        """The "add" of every request whose prefix read finished (with the blocks it found)."""
        added = []
        for request_id, (read, add) in list(self.reading.items()):
            if not read.done():
                continue
            del self.reading[request_id]
            hit = None if read.exception() is not None else read.result()  # (a failed read: a miss)
            if hit is not None:
                add[4]["preloaded"] = hit
            added.append(add)
        return added

    def _fetched(self) -> list[tuple]:
        """``("fetched", header, read)`` of every hand-off whose blocks were read."""
        done = [rid for rid, (read, _) in self.fetching.items() if read.done()]
        return [("fetched", header, read) for read, header in map(self.fetching.pop, done)]

    def _control_message(self, raw: bytes) -> tuple | None:
        """The engine loop's form of a message from the API server (None: nothing for it)."""
        from moeinfra.server.messages import (
            Abort,
            Add,
            BadFrame,
            Rejoin,
            Release,
            Shutdown,
            decode_to_rank,
        )

        try:
            message = decode_to_rank(raw)
        except BadFrame as err:
            self._drop("control", err)
            return None
        if isinstance(message, Add):
            add = (
                "add",
                message.request_id,
                message.prompt_ids,
                message.params,
                {"handoff": message.handoff},
            )
            # a request wanting its prompt's log-probabilities computes the whole prompt
            if self.disk is None or message.params.prompt_logprobs is not None:
                return add
            # only the blocks memory lacks are read (memory may still evict them before
            # admission; then the scheduler drops the read blocks and computes)
            ids = message.prompt_ids
            skip = self.core.blocks.cached_prefix_tokens(ids)
            read = self.reader.submit(self.disk.lookup, ids, skip_tokens=skip)
            self.reading[message.request_id] = (read, add)
            return None
        if isinstance(message, Release):
            self.connector.release(message.request_id)
            return None
        if isinstance(message, Abort):
            if self.connector is not None:  # (blocks it lent for the request go too)
                self.connector.release(message.request_id)
            if self.reading.pop(message.request_id, None) is not None:
                return None  # aborted while its prefix was read: never added
            return ("abort", message.request_id)
        if isinstance(message, Shutdown):
            self.refused = message.reason
            return ("shutdown",)
        if isinstance(message, Rejoin):
            return ("rejoin",)
        self.welcomed = True
        return None

    def _drop(self, socket: str, err: Exception) -> None:
        """Count a frame that was not a message (reported to the server); say so once."""
        self.dropped_frames += 1
        if self.dropped_frames == 1:
            print(
                f"unit {self.spec.unit_id} rank {self.rank}: dropped a frame on its {socket} "
                f"socket that is not a message ({err}); further ones are counted in the API "
                "server's moeinfra:dropped_frames_total",
                file=sys.stderr,
                flush=True,
            )

    def handle(self, message: tuple) -> None:
        from moeinfra.server.messages import Failed

        if message[0] == "kv":
            self._arrive(message[1])
        elif message[0] == "fetched":
            self._fetched_blocks(message[1], message[2])
        elif message[0] == "rejoin":
            self.rejoin()
        elif message[0] == "failed":
            self._send(Failed(message[1], message[2]))

    def _arrive(self, frames) -> None:
        from moeinfra.server.messages import BadFrame, Failed, decode_kv_header

        try:
            header = decode_kv_header(frames[0].buffer)
        except BadFrame as err:
            self._drop("KV", err)
            return
        if not header.source:
            self._take(header, [f.buffer for f in frames[1:]])
        elif self.fetcher is None:
            self._send(
                Failed(
                    header.request_id,
                    f"its prefill unit lent its KV blocks to be read through Mooncake (from "
                    f"{header.source}), and decode unit {self.spec.unit_id} uses "
                    f"--kv-connector {self.spec.kv_connector}: start both with the same one",
                )
            )
        else:
            read = self.fetcher.submit(self.connector.fetch, header)
            self.fetching[header.request_id] = (read, header)

    def _fetched_blocks(self, header, read: Future) -> None:
        from moeinfra.server.kv_transfer import TransferError
        from moeinfra.server.messages import Failed

        try:
            blocks = read.result()
        except TransferError as err:
            self._send(Failed(err.request_id, str(err)))
            return
        except Exception as err:  # (a transfer engine's own error must not stop the rank)
            self._send(Failed(header.request_id, f"reading its KV blocks failed: {err}"))
            return
        self._take(header, blocks)

    def _take(self, header, blocks) -> None:
        """Verify a hand-off's blocks and start decoding its request."""
        from moeinfra.server.kv_transfer import TransferError, verify
        from moeinfra.server.messages import Failed, Received

        data = self.core.cache.data
        try:
            arrival = verify(header, blocks, data.shape[0], data.shape[2], data.dtype)
        except TransferError as err:
            self._send(Failed(err.request_id, str(err)))
            return
        self.received_bytes += arrival.nbytes
        try:
            self.core.add_request(
                arrival.request_id,
                arrival.prompt_ids,
                arrival.params,
                output_ids=arrival.output_ids,
                preloaded=arrival.preloaded,
                drafts=arrival.drafts,
            )
        except InputError as err:
            self._send(Failed(arrival.request_id, str(err)))
            return
        self._send(Received(arrival.request_id))

    def emit(self, outputs) -> None:
        from moeinfra.server.messages import Failed, Outputs

        if outputs:
            self._send(Outputs(outputs))
        handoffs, self.core.handoffs = self.core.handoffs, []
        for h in handoffs:
            self._push(h)
        while self.send_failures:
            self._send(Failed(*self.send_failures.pop()))
        if self.core.ended_at_prefill:
            ended, self.core.ended_at_prefill = self.core.ended_at_prefill, []
            for prompt_ids, kv, ready in ended:
                self._store(prompt_ids, kv, ready)
        if self.core.steps != self.stepped:
            self.stepped = self.core.steps
            self.step_seconds.append(
                (self.stepped, time.perf_counter() - self.iteration_began, time.time())
            )
        now = time.monotonic()
        if now - self.last_report >= REPORT_S:
            self.report(now)
        if not self.welcomed and now - self.hello_at > WELCOME_WAIT_S and not self.warned:
            self.warned = True
            print(
                f"unit {self.spec.unit_id} rank {self.rank}: no answer from the API server at "
                f"{self.spec.server} {WELCOME_WAIT_S:.0f} s after saying hello (is it up, and "
                "do both use the same --secret-file?)",
                file=sys.stderr,
                flush=True,
            )

    def _push(self, handoff) -> None:
        self.sender.submit(self._send_kv, handoff)
        self._store(handoff.prompt_ids, handoff.kv, handoff.ready)

    def _send_kv(self, handoff) -> None:
        """Frame, check-sum and queue a hand-off on its decode rank's socket (sender thread)."""
        import zmq

        from moeinfra.server.kv_transfer import TransferError
        from moeinfra.server.secret import connect_securely

        if handoff.ready is not None:
            handoff.ready.synchronize()
        address = handoff.target
        sock = self.kv_out.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            sock.setsockopt(zmq.SNDHWM, 0)
            if self.keys is not None:
                connect_securely(sock, self.keys)
            try:
                sock.connect(address)
            except zmq.ZMQError as err:
                sock.close(linger=0)
                self.send_failures.append((handoff.request_id, f"KV address {address}: {err}"))
                return
            self.kv_out[address] = sock
        try:
            frames = self.connector.frames(handoff, self.core.config.block_size)
        except TransferError as err:
            self.send_failures.append((handoff.request_id, str(err)))
            return
        sock.send_multipart(frames, copy=False)  # ZeroMQ's I/O thread sends from here
        self.sent_bytes += handoff.kv.nbytes
        self.handoffs_sent += 1

    def _store(self, prompt_ids, kv, ready=None) -> None:
        if self.disk is None or self.pending_writes > 64:
            return
        self.pending_writes += 1

        def write():
            try:
                if ready is not None:
                    ready.synchronize()
                self.disk.store(prompt_ids, kv)
            finally:
                self.pending_writes -= 1

        self.writer.submit(write)

    def report(self, now: float) -> None:
        from moeinfra.server.messages import State

        core = self.core
        self.last_report = now
        disk = self.disk.stats if self.disk is not None else None
        spec = core.spec_stats
        load = expert_gpu_load(core)
        self._send(
            State(
                waiting=len(core.scheduler.waiting),
                running=len(core.scheduler.running),
                kv_blocks_used=core.blocks.num_used_blocks,
                kv_blocks_total=core.blocks.num_blocks,
                prefix_hit_tokens=core.blocks.hit_tokens,
                prefix_queried_tokens=core.blocks.queried_tokens,
                disk_hit_tokens=disk.hit_tokens if disk else 0,
                disk_written_blocks=disk.written_blocks if disk else 0,
                expert_gpu_load=None if load is None else load.tolist(),
                rebalances=core.rebalances,
                kv_sent_bytes=self.sent_bytes,
                kv_received_bytes=self.received_bytes,
                # cumulative, as SpecStats counts them (the server adds the increments)
                spec_num_drafts=spec.num_drafts,
                spec_num_draft_tokens=spec.num_draft_tokens,
                spec_num_accepted_tokens=spec.num_accepted_tokens,
                spec_accepted_per_pos=spec.per_position.tolist(),
                dropped_frames=self.dropped_frames,
                preemptions=core.scheduler.num_preemptions,
                steps=self._new_steps(),
            ),
            droppable=True,
        )

    def _new_steps(self) -> list[tuple]:
        """``(step, prefill tokens, decode tokens, attended keys, sampled rows, seconds, ended at
        (Unix time))`` of the steps since the last report (the server joins the ranks' rows of a
        step by its number)."""
        core, timed = self.core, self.step_seconds
        self.step_seconds = []
        rows = []
        for step, seconds, ended in timed:
            back = core.steps - step  # core.stats[-1] is the latest step (indexed from the end)
            if back < len(core.stats):
                s = core.stats[-1 - back]
                rows.append(
                    (
                        step,
                        s.prefill_tokens,
                        s.decode_tokens,
                        s.attended_keys,
                        s.sampled,
                        seconds,
                        ended,
                    )
                )
        return rows

    def close(self, linger_s: float | None = None) -> None:
        """Say goodbye and close the sockets; ``linger_s=0`` (a failing rank) drops what is
        unsent instead of waiting for it."""
        from moeinfra.server.messages import Bye

        if self.writer is not None:
            self.writer.shutdown(wait=linger_s is None)
            self.reader.shutdown(wait=False, cancel_futures=True)
        # (a failing rank drops the hand-offs not yet queued; the sender is done either way
        # before its sockets close)
        self.sender.shutdown(wait=True, cancel_futures=linger_s is not None)
        if self.fetcher is not None:
            self.fetcher.shutdown(wait=True, cancel_futures=True)
        if self.connector is not None:
            self.connector.close()
        self._send(Bye(self.rank))
        linger = None if linger_s is None else int(linger_s * 1000)
        for sock in self.kv_out.values():
            sock.close(linger=linger)
        if self.kv_in is not None:
            self.kv_in.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.control.close(linger=linger)
        self.ctx.term()


def rank_main(spec: UnitSpec, rank: int, init_method: str | None, local_rank: int = 0) -> str:
    """One rank of a unit: join the unit's process group, load the engine, serve until shutdown.
    Returns why the API server refused the unit ("" when it stopped it normally)."""
    threads = spec.threads or threads_per_rank(spec.local_ranks or spec.ranks)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist

    from moeinfra.engine.core import EngineCore
    from moeinfra.engine.device import collective_backend, place_rank
    from moeinfra.engine.worker import serve_loop
    from moeinfra.moe.comm import Communicator

    torch.set_num_threads(threads)
    try:
        device = place_rank(spec.engine.device, local_rank)
        if spec.ranks > 1:
            dist.init_process_group(
                collective_backend(device),
                init_method=init_method,
                rank=rank,
                world_size=spec.ranks,
                timeout=timedelta(seconds=spec.collective_timeout_s),
            )
        incarnation = agree_incarnation(spec.ranks, device)
        comm = Communicator(delay_s=spec.comm_delay_s)
        core = EngineCore(Path(spec.model_dir), spec.engine, comm)
        if spec.noop_model:
            core.model = NoopModel(core.model, core.model_config)
        else:
            core.warm_up()  # before hello: no request waits behind first-call costs
        server = RankServer(spec, rank, core, incarnation)
        try:
            server.hello()
            serve_loop(core, server.receive, server.emit, server.handle)
        except BaseException:
            # no orderly goodbye: peers may sit in a collective this rank will never join
            server.close(linger_s=0)
            raise
        server.close()
        comm.close()
        if spec.ranks > 1:
            dist.destroy_process_group()
        if server.refused:
            print(f"unit {spec.unit_id} rank {rank}: {server.refused}", file=sys.stderr, flush=True)
        return server.refused
    except BaseException as err:
        if not isinstance(err, KeyboardInterrupt):
            print(
                f"unit {spec.unit_id} rank {rank} failed:\n{traceback.format_exc(limit=8)}",
                file=sys.stderr,
                flush=True,
            )
        raise


def elastic_rank(spec: UnitSpec) -> str:
    """A rank as the elastic agent starts it (``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` in its environment): :func:`rank_main`."""
    world = int(os.environ["WORLD_SIZE"])
    if world != spec.ranks:
        raise RuntimeError(
            f"the rendezvous made a world of {world} ranks, the unit has {spec.ranks}"
        )
    return rank_main(spec, int(os.environ["RANK"]), "env://", int(os.environ["LOCAL_RANK"]))


def agree_incarnation(ranks: int, device) -> str:
    """A name for this start of the unit that all its ranks share: rank 0 draws it and every
    rank takes it from rank 0 (a restart draws another)."""
    import secrets

    import torch
    import torch.distributed as dist

    drawn = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=device)
    if ranks > 1:
        dist.broadcast(drawn, 0)
    return f"{int(drawn.item()):016x}"


def _watch_parent(parent_pid: int, on_gone) -> None:
    """Call ``on_gone()`` from a daemon thread once ``parent_pid`` no longer exists."""
    import threading

    def watch():
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                on_gone()
                return
            except PermissionError:
                pass
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def run_unit(spec: UnitSpec, parent_pid: int | None = None) -> int:
    """Run a unit's ranks until they shut down; returns a process exit code (0: clean, 1: the
    API server refused the unit or its ranks failed past ``max_restarts``, 130: interrupted).

    With ``parent_pid``, the unit exits when that process (the server that started it) is gone."""
    if spec.role not in ROLES:
        raise ValueError(f"role={spec.role!r} is not one of {', '.join(ROLES)}")
    if spec.ranks == 1 and not spec.max_restarts:
        if parent_pid is not None:
            _watch_parent(parent_pid, lambda: os._exit(1))
        try:
            return 1 if rank_main(spec, 0, None) else 0
        except KeyboardInterrupt:
            return 130
    return _run_elastic(spec, parent_pid)


def _run_elastic(spec: UnitSpec, parent_pid: int | None) -> int:
    """The unit's ranks on this host under torch's elastic agent (see the module docstring)."""
    import signal
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    here = spec.local_ranks or spec.ranks
    hosts = spec.ranks // here
    # the agent's folder for its ranks' error files, gone when the unit is (the ranks print
    # their tracebacks to stderr themselves)
    logs = tempfile.TemporaryDirectory(prefix="moeinfra-unit-")
    config = LaunchConfig(
        min_nodes=hosts,
        max_nodes=hosts,
        nproc_per_node=here,
        run_id=spec.unit_id,
        rdzv_backend="c10d",
        # one host: the rendezvous store on a port the agent binds and keeps
        rdzv_endpoint=spec.rendezvous.removeprefix("tcp://") if spec.rendezvous else "127.0.0.1:0",
        rdzv_configs={"is_host": spec.node_rank == 0},
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=logs.name),
    )
    # A store of their own for the ranks of each start, which rank 0 hosts on a port its agent
    # picked free (torchrun's way before the shared store; a port taken in between fails that
    # start): on the agent's store, torch's default, the ranks of a start after a restart read
    # the addresses the previous start published (nothing names their keys by start) and fail
    # to connect.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if parent_pid is not None:  # the agent stops its ranks on SIGTERM
        _watch_parent(parent_pid, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        refusals = elastic_launch(config, elastic_rank)(spec)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(
            f"unit {spec.unit_id}: rank {rank} failed (exit code {failure.exitcode}) and "
            f"--max-restarts={spec.max_restarts} restarts are used up",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except SignalException as err:
        return 130 if err.sigval == signal.SIGINT else 1
    finally:
        logs.cleanup()
    return 1 if any(refusals.values()) else 0
