"""``moeinfra serve up``: the API server, its router and balancers, and the local units.

Every unit is its own process group of engine ranks started with the same command a user runs on
another host (``moeinfra serve unit --server tcp://HOST:PORT ...``), so a server with no local
units (``--prefill-units 0 --decode-units 0``) serves whatever units join it.

A local unit that exits on its own (a crash, kill -9, the OOM killer) is started again under its
id, at once the first time and then after 1, 2, 4 ... up to 60 s while it keeps failing
(:data:`RESTART_BACKOFF_S`); units on other hosts are their own hosts' to restart (they rejoin).

SIGINT / SIGTERM drain: uvicorn stops accepting connections and lets the requests in progress finish
(up to ``drain_timeout_s``); then what is left ends with an error, every unit is told to stop and
waited for (killed after ``wait_s``), and the sockets close. Local units also exit if the server
process disappears without draining (they watch its pid).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from moeinfra.engine.config import EngineConfig
from moeinfra.errors import InputError
from moeinfra.server.autoscale import AutoscalePolicy, Autoscaler

log = logging.getLogger(__name__)

#: ``serve up``'s layout when a user gives no ``--*-units`` / ``--*-ranks`` option: DeepSeek's
#: disaggregation (one prefill and one decode unit of 2 ranks) where the machine has a core (CPU)
#: or a GPU (CUDA) for each of the 4 ranks besides the API server's core, else one colocated unit
#: of one rank. On a 2-core machine the four ranks share two cores: a burst of 32 requests got
#: 0.6x the output tokens/s and 4x the TTFT p50 of one colocated rank (docs/benchmarks.md).
DISAGGREGATED = {
    "prefill_units": 1,
    "prefill_ranks": 2,
    "decode_units": 1,
    "decode_ranks": 2,
    "colocated_units": 0,
    "colocated_ranks": 2,
}
ONE_COLOCATED_RANK = {
    "prefill_units": 0,
    "prefill_ranks": 2,
    "decode_units": 0,
    "decode_ranks": 2,
    "colocated_units": 1,
    "colocated_ranks": 1,
}


#: A local unit's restarts: the first at once, then after 1, 2, 4 ... seconds (doubling with each
#: restart in the last ``RESTART_WINDOW_S``) up to the last value.
RESTART_BACKOFF_S = (1.0, 60.0)
RESTART_WINDOW_S = 300.0


def restart_delay_s(recent_restarts: int) -> float:
    """Seconds to wait before restarting a unit that restarted ``recent_restarts`` times within
    :data:`RESTART_WINDOW_S` (a crash loop backs off; a unit that ran for a while restarts at
    once)."""
    if recent_restarts == 0:
        return 0.0
    first, most = RESTART_BACKOFF_S
    return min(most, first * 2 ** (recent_restarts - 1))


def default_layout(device: str = "auto") -> dict[str, int]:
    """The units ``serve up`` starts when given no layout (see :data:`DISAGGREGATED`) for the
    engine option ``device``."""
    if device != "cpu":
        import torch

        if torch.cuda.is_available():
            return DISAGGREGATED if torch.cuda.device_count() >= 4 else ONE_COLOCATED_RANK
    return DISAGGREGATED if (os.cpu_count() or 1) >= 5 else ONE_COLOCATED_RANK


@dataclass
class ServeOptions:
    """Everything ``serve up`` takes (see ``moeinfra serve up --help``)."""

    model: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_units: int = 1
    prefill_ranks: int = 2
    decode_units: int = 1
    decode_ranks: int = 2
    colocated_units: int = 0
    colocated_ranks: int = 2
    control: str = "tcp://127.0.0.1:0"
    kv_host: str = "127.0.0.1"
    kv_connector: str = "zmq"  # how prefill units' KV blocks reach decode units (CONNECTORS)
    kv_cache_dir: Path | None = None
    kv_cache_bytes: int = 1 << 30
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None
    max_queue: int = 64
    max_model_len: int | None = None
    start_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    unit_timeout_s: float = 10.0
    kv_transfer_timeout_s: float = 30.0
    comm_delay_s: float = 0.0
    autoscale: AutoscalePolicy | None = None
    noop_model: bool = False
    cpu_threads: int | None = None  # per rank; None: this host's cores shared by its ranks
    secret_file: Path | None = None  # shared secret: CURVE on the control and KV sockets
    max_request_bytes: int = 32 << 20  # larger bodies get a 413
    metric_names: str = "both"  # moeinfra, vllm or both
    chat_template: str | None = None  # a Jinja file or built-in name (BUILT_IN_TEMPLATES)
    tool_call_parser: str | None = None  # deepseek_v3, deepseek_v31 or deepseek_v32
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None  # deepseek_r1 or deepseek_v3
    insecure: bool = False  # bind the control / KV sockets beyond loopback without a secret

    def __post_init__(self) -> None:
        for name in ("prefill_units", "decode_units", "colocated_units"):
            if getattr(self, name) < 0:
                raise InputError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 0")
        for name in ("prefill_ranks", "decode_ranks", "colocated_ranks"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if not 0 <= self.port < 65536:
            raise InputError(f"--port={self.port} must be in 0..65535")
        if self.prefill_units and not self.decode_units:
            raise InputError(
                f"--prefill-units={self.prefill_units} needs --decode-units >= 1 to hand off to"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise InputError(f"--cpu-threads={self.cpu_threads} must be >= 1")
        if self.max_request_bytes < 1:
            raise InputError(f"--max-request-bytes={self.max_request_bytes} must be >= 1")
        from moeinfra.server.kv_connector import check_connector

        check_connector(self.kv_connector, self.secret_file)
        from moeinfra.server.metrics import NAME_SETS

        if self.metric_names not in NAME_SETS:
            raise InputError(
                f"--metric-names={self.metric_names!r} must be one of {', '.join(NAME_SETS)}"
            )
        from moeinfra.server.reasoning import REASONING_PARSERS
        from moeinfra.server.tool_parsers import PARSERS

        for option, value, allowed in (
            ("--tool-call-parser", self.tool_call_parser, PARSERS),
            ("--reasoning-parser", self.reasoning_parser, REASONING_PARSERS),
        ):
            if value is not None and value not in allowed:
                raise InputError(f"{option}={value!r} must be one of {', '.join(allowed)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise InputError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.max_queue < 0:
            raise InputError(f"--max-queue={self.max_queue} must be >= 0")
        if not self.unit_timeout_s >= 1.0:  # ranks report every 0.25 s and after every step
            raise InputError(f"--unit-timeout={self.unit_timeout_s} must be >= 1 second")
        if not self.kv_transfer_timeout_s > 0:
            raise InputError(f"--kv-transfer-timeout={self.kv_transfer_timeout_s} must be > 0")
        if not self.drain_timeout_s >= 0:
            raise InputError(f"--drain-timeout={self.drain_timeout_s} must be >= 0")
        if self.autoscale is not None:
            for role in ("prefill", "decode"):
                low, high = self.autoscale.bounds(role)
                count = getattr(self, f"{role}_units")
                if not low <= count <= high:
                    raise InputError(
                        f"--{role}-units={count} must be within --min-{role}-units={low} and "
                        f"--max-{role}-units={high} with --autoscale"
                    )


#: Chat templates that ship with moeinfra (``--chat-template NAME``): DeepSeek's, also writing a
#: request's ``tools`` into the system prompt in the format the tool parser of the same version
#: reads (DeepSeek's own V3 / V3.1 templates leave ``tools`` out).
BUILT_IN_TEMPLATES = ("deepseek_v3_tools", "deepseek_v31_tools")


def chat_template_text(value: str) -> str:
    """The Jinja text of ``--chat-template``: a file, or a name in :data:`BUILT_IN_TEMPLATES`."""
    if value in BUILT_IN_TEMPLATES and not Path(value).exists():
        from importlib import resources

        return resources.files("moeinfra.server").joinpath(f"templates/{value}.jinja").read_text()
    path = Path(value)
    if not path.is_file():
        raise InputError(
            f"--chat-template={value}: no such file (or a built-in: {', '.join(BUILT_IN_TEMPLATES)})"
        )
    return path.read_text()


def unit_command(
    role: str,
    ranks: int,
    server: str,
    options: ServeOptions,
    model_dir: Path,
    unit_id: str | None = None,
    parent_pid: int | None = None,
) -> list[str]:
    """The ``moeinfra serve unit`` command line of a unit (what runs on another host, too)."""
    cmd = [sys.executable, "-m", "moeinfra.cli", "serve", "unit"]
    cmd += ["--server", server, "--role", role, "--ranks", str(ranks), "--model", str(model_dir)]
    cmd += ["--kv-host", options.kv_host, "--kv-connector", options.kv_connector]
    if unit_id:
        cmd += ["--unit-id", unit_id]
    if parent_pid:
        cmd += ["--parent-pid", str(parent_pid)]
    if options.kv_cache_dir is not None and role != "decode":
        cmd += ["--kv-cache-dir", str(options.kv_cache_dir)]
        cmd += ["--kv-cache-bytes", str(options.kv_cache_bytes)]
    if options.comm_delay_s:
        cmd += ["--comm-delay", f"{float(options.comm_delay_s)!r}s"]
    if options.noop_model:
        cmd += ["--noop-model"]
    if options.cpu_threads is not None:
        cmd += ["--cpu-threads", str(options.cpu_threads)]
    if options.secret_file is not None:
        cmd += ["--secret-file", str(Path(options.secret_file).resolve())]
    if options.insecure:
        cmd += ["--insecure"]
    defaults = EngineConfig()
    for f in fields(EngineConfig):
        value = getattr(options.engine, f.name)
        if value == getattr(defaults, f.name):
            continue
        if f.name not in UNIT_ENGINE_FLAGS:
            raise InputError(f"engine option {f.name}={value!r} cannot be passed to a unit")
        cmd += [UNIT_ENGINE_FLAGS[f.name], str(value)]
    return cmd


#: Engine options ``moeinfra serve unit`` takes, and their flags (the others keep their defaults).
UNIT_ENGINE_FLAGS = {
    "block_size": "--block-size",
    "num_kv_blocks": "--num-kv-blocks",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "memory_utilization": "--memory-utilization",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "dtype": "--dtype",
    "device": "--device",
    "redundant_experts": "--redundant-experts",
    "eplb_interval": "--eplb-interval",
    "overlap": "--overlap",
    "num_speculative_tokens": "--speculative-tokens",
}


def _listen(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # without it Nagle holds a response's second small write for the client's delayed ACK (~40 ms)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise InputError(
            f"--port={port}: cannot listen on {host}:{port} ({err.strerror})"
        ) from None
    sock.listen(2048)
    return sock


def check_model_len(max_model_len: int, kv_tokens: int, options: ServeOptions) -> int:
    """``max_model_len`` within one rank's KV cache of ``kv_tokens``: lowered to it unless the
    user asked for more (then an error naming both, as vLLM refuses to start)."""
    if max_model_len <= kv_tokens:
        return max_model_len
    if options.max_model_len is None:
        return kv_tokens
    raise InputError(
        f"--max-model-len={max_model_len} exceeds one rank's KV cache ({kv_tokens} tokens: "
        "--num-kv-blocks x --block-size, or what --kv-cache-memory-bytes / "
        "--memory-utilization leave)"
    )


def unit_engine(options: ServeOptions, role_ranks: int) -> EngineConfig:
    """A local unit's engine options: with its cache sized from memory, its share of
    ``memory_utilization`` by its ranks among every rank ``serve up`` runs on this host."""
    engine = options.engine
    if engine.num_kv_blocks is not None or engine.kv_cache_memory_bytes is not None:
        return engine
    share = engine.memory_utilization * role_ranks / max(local_ranks(options), role_ranks)
    return replace(engine, memory_utilization=share)


def local_ranks(options: ServeOptions) -> int:
    """Engine ranks ``serve up`` runs on this host at most: the units it starts (with
    ``--autoscale``, as many as the policy may add)."""
    count = {
        "prefill": options.prefill_units,
        "decode": options.decode_units,
        "colocated": options.colocated_units,
    }
    if options.autoscale is not None:
        for role in ("prefill", "decode"):
            count[role] = max(count[role], options.autoscale.bounds(role)[1])
    return sum(n * getattr(options, f"{role}_ranks") for role, n in count.items())


def oversubscription_note(options: ServeOptions) -> str | None:
    """A warning when this host's ranks run more CPU threads than it lets this process use (each
    rank's ``--cpu-threads`` or ``OMP_NUM_THREADS`` times the local ranks) and fewer threads a
    rank would fit; None otherwise or on a GPU. Threads that outnumber the cores wait for each other: on 2 cores, four ranks of 2
    threads each served a burst at a seventh of the output tokens/s of four ranks of one."""
    from moeinfra.engine.device import resolve_device
    from moeinfra.server.unit import threads_per_rank, usable_cores

    if resolve_device(options.engine.device).type != "cpu":
        return None
    ranks = local_ranks(options)
    threads = options.cpu_threads or threads_per_rank(ranks)
    cores = usable_cores()
    if ranks * threads <= cores or threads <= max(1, cores // max(ranks, 1)):
        return None  # within the cores, or already one thread a rank
    return (
        f"moeinfra serve: {ranks} local ranks x {threads} CPU threads each on {cores} cores "
        "(--cpu-threads or OMP_NUM_THREADS): oversubscribed, steps will be slow; leave both "
        "unset to share the cores among the ranks"
    )


def serve(options: ServeOptions, announce=print) -> int:
    """Run the server until SIGINT/SIGTERM; returns an exit code. ``announce(line)`` gets the
    ready line (with the real port) and the shutdown summary."""
    import uvicorn
    from fastapi import FastAPI

    from moeinfra.engine.hf_config import read_config
    from moeinfra.engine.registry import architecture
    from moeinfra.engine.tiny import default_model
    from moeinfra.engine.tokenizer import Tokenizer
    from moeinfra.moe import cpu_features
    from moeinfra.server.api import ServerLimits, create_app, tokenizer_config
    from moeinfra.server.chat_output import ChatOptions
    from moeinfra.server.metrics import ServerMetrics
    from moeinfra.server.router import Router
    from moeinfra.server.secret import check_exposure, read_secret
    from moeinfra.server.unit import check_drafting, config_digest, threads_per_rank

    if options.cpu_threads is None:
        options = replace(options, cpu_threads=threads_per_rank(local_ranks(options)))
    model_dir = Path(options.model) if options.model is not None else default_model()
    raw = read_config(model_dir)
    source = str(model_dir / "config.json")
    model_config = architecture(raw["model_type"], source).parse_config(raw, source)
    engine = options.engine
    check_drafting(model_dir, engine.num_speculative_tokens)
    tokenizer = Tokenizer(model_dir)
    if options.chat_template is not None:
        tokenizer.set_chat_template(chat_template_text(options.chat_template))
    max_model_len = options.max_model_len or model_config.max_position_embeddings
    if engine.num_kv_blocks is not None:  # else known once the units have sized their caches
        max_model_len = check_model_len(
            max_model_len, engine.num_kv_blocks * engine.block_size, options
        )
    name = options.served_model_name or model_dir.name
    keys = read_secret(options.secret_file) if options.secret_file is not None else None
    exposed = {"--control": options.control}
    if options.decode_units or options.autoscale is not None:
        exposed["--kv-host"] = options.kv_host
    check_exposure(exposed, keys, options.insecure)
    metrics = ServerMetrics(options.metric_names, name, max_model_len)
    router = Router(
        options.control,
        config_digest(model_dir),
        max_queue=options.max_queue,
        unit_timeout_s=options.unit_timeout_s,
        kv_transfer_timeout_s=options.kv_transfer_timeout_s,
        metrics=metrics,
        drafting=engine.num_speculative_tokens > 0,
        keys=keys,
    )
    cache_probe = None
    if options.kv_cache_dir is not None:
        cache_probe = _disk_probe(options, model_dir, model_config, engine)
    listener = _listen(options.host, options.port)
    port = listener.getsockname()[1]

    ranks_of = {
        "prefill": options.prefill_ranks,
        "decode": options.decode_ranks,
        "colocated": options.colocated_ranks,
    }

    def spawn(role: str, unit_id: str | None = None) -> None:
        """Start one local unit of ``role`` (it joins the router when its ranks are up)."""
        unit_id = unit_id or f"{role}-{uuid.uuid4().hex[:6]}"
        local = replace(options, engine=unit_engine(options, ranks_of[role]))
        cmd = unit_command(
            role, ranks_of[role], router.control_address, local, model_dir, unit_id, os.getpid()
        )
        proc = subprocess.Popen(cmd, start_new_session=True)
        router.expect_unit(unit_id, role, ranks_of[role], proc)

    async def supervise() -> None:
        """Start again every local unit that exited on its own (see RESTART_BACKOFF_S)."""
        restarts: dict[str, list[float]] = {}
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for unit in list(router.units.values()):
                proc = unit.process
                if proc is None or unit.alive or unit.draining or unit.stopped:
                    continue
                if not router.accepting or proc.poll() is None:
                    continue
                recent = [t for t in restarts.get(unit.unit_id, []) if now - t < RESTART_WINDOW_S]
                if recent and now - recent[-1] < restart_delay_s(len(recent)):
                    continue
                restarts[unit.unit_id] = [*recent, now]
                log.warning(
                    "unit %s (%s) exited with code %s; starting it again (restart %d in the last "
                    "%.0f s)", unit.unit_id, unit.role, proc.returncode, len(recent) + 1,
                    RESTART_WINDOW_S,
                )  # fmt: skip
                router.notes.append(f"unit {unit.unit_id} ({unit.role}) started again by serve up")
                metrics.unit_restarts.labels(unit.role).inc()
                spawn(unit.role, unit.unit_id)

    @contextlib.asynccontextmanager
    async def lifespan(app_: FastAPI):
        await router.start()
        scaler = None
        try:
            for role, count in (
                ("prefill", options.prefill_units),
                ("decode", options.decode_units),
                ("colocated", options.colocated_units),
            ):
                for _ in range(count):
                    spawn(role)
            await router.wait_ready(options.start_timeout_s)
            capacity = router.kv_tokens_per_rank()
            if capacity is not None:
                limits.max_model_len = check_model_len(limits.max_model_len, capacity, options)
        except BaseException:
            await router.shutdown()
            raise
        supervisor = asyncio.create_task(supervise())
        if options.autoscale is not None:
            autoscaler = Autoscaler(router, spawn, options.autoscale)
            app_.state.autoscaler = autoscaler
            scaler = asyncio.create_task(autoscaler.run())
        units = ", ".join(f"{u.role} {u.unit_id} x{u.num_ranks}" for u in router.units.values())
        announce(f"moeinfra serve: this host's CPU: {cpu_features.detect().describe()}")
        if (note := oversubscription_note(options)) is not None:
            announce(note)
        announce(
            f"moeinfra serve: ready at http://{options.host}:{port}/v1 (model {name}; units: "
            f"{units or 'none yet'}; control {router.control_address})"
        )
        yield
        supervisor.cancel()
        if scaler is not None:
            scaler.cancel()
        await router.shutdown()
        announce("moeinfra serve: stopped (all units exited)")

    limits = ServerLimits(max_model_len=max_model_len)
    app = create_app(
        router,
        tokenizer,
        name,
        limits,
        cache_probe=cache_probe,
        metrics=metrics,
        lifespan=lifespan,
        model_config=raw,
        model_root=str(model_dir),
        tokenizer_config=tokenizer_config(model_dir),
        max_request_bytes=options.max_request_bytes,
        chat_options=ChatOptions(
            options.tool_call_parser, options.enable_auto_tool_choice, options.reasoning_parser
        ),
    )
    app.state.router = router
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=options.drain_timeout_s,
        timeout_keep_alive=5,
    )
    server = _draining_server_class()(config)
    try:
        asyncio.run(server.serve(sockets=[listener]))
    finally:
        listener.close()
    return 0 if server.started else 1


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, but a drained shutdown on SIGINT/SIGTERM exits 0 (uvicorn re-raises
        the signal after draining, which would end the process with -2/-15)."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return DrainingServer


def _disk_probe(options: ServeOptions, model_dir: Path, model_config, engine: EngineConfig):
    """``prompt_ids -> tokens on disk`` for the prefill balancer (files present, not read)."""
    from moeinfra.engine.device import resolve_device, resolve_dtype
    from moeinfra.engine.models.mtp import with_mtp_layer
    from moeinfra.engine.registry import architecture
    from moeinfra.server.disk_cache import DiskKVCache, model_fingerprint

    arch = architecture(model_config.model_type, str(model_dir))
    dtype = resolve_dtype(engine.dtype, resolve_device(engine.device))  # as the units resolve it
    layout = arch.kv_layout(model_config, dtype, engine.block_size)
    drafting = engine.num_speculative_tokens > 0
    if drafting:  # a drafting unit caches (and stores) the MTP layer's KV too
        layout = with_mtp_layer(layout)
    shape = (layout.num_layers, layout.values_per_token)
    fingerprint = model_fingerprint(model_dir, layout.dtype, engine.block_size, shape)
    cache = DiskKVCache(
        options.kv_cache_dir,
        fingerprint,
        engine.block_size,
        shape[0],
        shape[1],
        layout.dtype,
        options.kv_cache_bytes,
        reuse_last_block=not drafting,
    )
    return cache.cached_tokens


def options_dict(options: ServeOptions) -> dict:
    """The options as plain values (for reports and ``--json``)."""
    out = asdict(options)
    out["engine"] = asdict(options.engine)
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}
