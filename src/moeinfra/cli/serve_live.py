"""``moeinfra serve up`` / ``serve unit``: the running inference system (see moeinfra.server)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from moeinfra.cli.options import (
    input_file,
    input_folder,
    output_file,
    output_folder,
    parse_duration_s,
)


def _engine_config(
    model_dir,
    num_kv_blocks,
    kv_cache_memory_bytes,
    memory_utilization,
    block_size,
    max_num_seqs,
    max_num_batched_tokens,
    dtype,
    redundant,
    eplb,
    overlap,
    device,
    speculative_tokens,
):
    from moeinfra.engine.config import EngineConfig
    from moeinfra.engine.registry import default_block_size
    from moeinfra.errors import InputError

    if block_size is None:
        block_size = default_block_size(model_dir)
    try:
        return EngineConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            memory_utilization=memory_utilization,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            dtype=dtype,
            redundant_experts=redundant,
            eplb_interval=eplb or None,
            overlap=overlap,
            device=device,
            num_speculative_tokens=speculative_tokens,
        )
    except InputError as exc:
        message = str(exc).replace("num_speculative_tokens=", "--speculative-tokens=")
        for name in ("num_kv_blocks", "kv_cache_memory_bytes", "memory_utilization"):
            message = message.replace(f"{name}=", f"--{name.replace('_', '-')}=")
        raise InputError(message) from None


_MODEL = typer.Option(
    None, "--model", "-m", help="Checkpoint folder (default: the built-in tiny one)."
)
_BLOCKS = typer.Option(
    None,
    "--num-kv-blocks",
    help="KV blocks per rank (default: sized from memory: --kv-cache-memory-bytes, else "
    "--memory-utilization).",
)
_KV_MEMORY = typer.Option(
    None, "--kv-cache-memory-bytes", help="One rank's KV cache in bytes (vLLM's flag)."
)
_UTILIZATION = typer.Option(
    0.9,
    "--memory-utilization",
    help="Share of the device's memory (the host's on the CPU) the ranks of a host use in all: "
    "weights, activations and the KV cache, which takes what is left (vLLM's "
    "--gpu-memory-utilization). serve up splits it over the units it starts by their ranks.",
)
_BLOCK = typer.Option(
    None,
    "--block-size",
    help="Tokens per KV block (default: the model's: 64; DeepSeek-V4 the least multiple of 64 "
    "holding whole compression windows and four sliding windows, 512 for V4-Flash and V4-Pro).",
)
_SEQS = typer.Option(256, "--max-num-seqs", help="Requests per rank batch.")
_TOKENS = typer.Option(2048, "--max-num-batched-tokens", help="Tokens per rank step.")
_DTYPE = typer.Option(
    "auto",
    "--dtype",
    help="auto (bfloat16 on a GPU, float32 on the CPU), float32, bfloat16, float16.",
)
_DEVICE = typer.Option(
    "auto", "--device", help="auto (a GPU when torch sees one), cpu, cuda or cuda:N."
)
_REDUNDANT = typer.Option(0, "--redundant-experts", help="Extra expert slots per unit (EPLB).")
_EPLB = typer.Option(0, "--eplb-interval", help="Rebalance experts every N steps (0: never).")
_SPECULATIVE = typer.Option(
    0,
    "--speculative-tokens",
    help="Draft tokens per decode step from the checkpoint's MTP layer, on every unit "
    "(0 = no speculative decoding).",
)
_CACHE_BYTES = typer.Option(1 << 30, "--kv-cache-bytes", help="Byte cap of the on-disk KV cache.")
_OVERLAP = typer.Option("auto", "--overlap", help="auto, none, prefill or decode.")
_DELAY = typer.Option(
    "0s",
    "--comm-delay",
    metavar="DURATION",
    help="Injected delay per all-to-all payload with a unit (us, ms, s): 2ms.",
)
_NOOP = typer.Option(
    False,
    "--noop-model",
    help="Benchmarks only: the model's forward returns zeros (the serving stack's own ceiling; "
    "the output is meaningless).",
)
_THREADS = typer.Option(
    None,
    "--cpu-threads",
    help="CPU threads per engine rank (default: OMP_NUM_THREADS, else this host's cores shared by "
    "its ranks).",
)


_SECRET = typer.Option(
    None,
    "--secret-file",
    help="A file holding a shared secret (16+ bytes; e.g. openssl rand -hex 32): the control and "
    "KV sockets then admit only peers with the same secret and encrypt what they carry (CurveZMQ). "
    "Needed to bind them beyond loopback.",
)
_CONNECTOR = typer.Option(
    "zmq",
    "--kv-connector",
    help="How a prompt's KV blocks reach the decode unit: zmq (frames behind the hand-off "
    "message), mooncake or mooncake-rdma (read by the decode rank through the Mooncake Transfer "
    "Engine; pip install 'moeinfra[mooncake]'). Prefill and decode units use the same one.",
)
_INSECURE = typer.Option(
    False,
    "--insecure",
    help="Bind the control / KV sockets beyond loopback without a secret (a trusted network).",
)


def register(app: typer.Typer) -> None:
    """Add ``up`` and ``unit`` to the ``serve`` command group."""

    @app.command()
    def up(
        model: Path | None = _MODEL,
        host: str = typer.Option("127.0.0.1", "--host", help="HTTP address to listen on."),
        port: int = typer.Option(8000, "--port", help="HTTP port (0: any free port)."),
        prefill_units: int | None = typer.Option(
            None,
            "--prefill-units",
            help="Prefill units. Without any layout option: 1 prefill + 1 decode unit of 2 ranks "
            "where the machine has a core (or GPU) per rank and one for the API server, else "
            "1 colocated unit of 1 rank. Given some, the others default to 1 / 2 / 1 / 2 / 0 / 2.",
        ),
        prefill_ranks: int | None = typer.Option(
            None, "--prefill-ranks", help="Ranks (EP) per prefill unit."
        ),
        decode_units: int | None = typer.Option(None, "--decode-units"),
        decode_ranks: int | None = typer.Option(
            None, "--decode-ranks", help="Ranks (EP) per decode unit."
        ),
        colocated_units: int | None = typer.Option(
            None, "--colocated-units", help="Units doing prefill and decode (no hand-off)."
        ),
        colocated_ranks: int | None = typer.Option(None, "--colocated-ranks"),
        control: str = typer.Option(
            "tcp://127.0.0.1:0",
            "--control",
            help="ZeroMQ address units connect to (port 0: any; use a routable host for units "
            "on other machines).",
        ),
        kv_host: str = typer.Option(
            "127.0.0.1",
            "--kv-host",
            help="Address local decode ranks receive KV on (and, with --kv-connector mooncake, "
            "prefill ranks lend it from).",
        ),
        kv_connector: str = _CONNECTOR,
        kv_cache_dir: Path | None = typer.Option(
            None, "--kv-cache-dir", help="On-disk prefix KV cache shared by prefill units."
        ),
        kv_cache_bytes: int = _CACHE_BYTES,
        served_model_name: str | None = typer.Option(
            None, "--served-model-name", help="Model id in the API (default: folder name)."
        ),
        max_queue: int = typer.Option(
            64, "--max-queue", help="Requests admitted beyond the decode slots before 503."
        ),
        max_model_len: int | None = typer.Option(
            None, "--max-model-len", help="Prompt + output tokens per request."
        ),
        drain_timeout: str = typer.Option(
            "30s",
            "--drain-timeout",
            metavar="DURATION",
            help="Time running requests get to finish on shutdown, with a unit (us, ms, s): 30s.",
        ),
        unit_timeout: str = typer.Option(
            "10s",
            "--unit-timeout",
            metavar="DURATION",
            help="Time a unit's ranks may stay silent (no report; a step longer than this counts "
            "too) before the unit is taken as lost and its requests retried or failed, with a "
            "unit (us, ms, s): 10s.",
        ),
        kv_transfer_timeout: str = typer.Option(
            "30s",
            "--kv-transfer-timeout",
            metavar="DURATION",
            help="Time a decode rank has to take a request's KV after its first token before the "
            "request fails (us, ms, s): 30s.",
        ),
        num_kv_blocks: int | None = _BLOCKS,
        kv_cache_memory_bytes: int | None = _KV_MEMORY,
        memory_utilization: float = _UTILIZATION,
        block_size: int | None = _BLOCK,
        max_num_seqs: int = _SEQS,
        max_num_batched_tokens: int = _TOKENS,
        dtype: str = _DTYPE,
        device: str = _DEVICE,
        redundant_experts: int = _REDUNDANT,
        eplb_interval: int = _EPLB,
        overlap: str = _OVERLAP,
        speculative_tokens: int = _SPECULATIVE,
        comm_delay: str = _DELAY,
        noop_model: bool = _NOOP,
        cpu_threads: int | None = _THREADS,
        secret_file: Path | None = _SECRET,
        insecure: bool = _INSECURE,
        max_request_bytes: int = typer.Option(
            32 << 20, "--max-request-bytes", help="Larger request bodies get a 413."
        ),
        metric_names: str = typer.Option(
            "both",
            "--metric-names",
            help="Names of the /metrics series: moeinfra, vllm (what vLLM's Grafana dashboards "
            "query) or both.",
        ),
        chat_template: str | None = typer.Option(
            None,
            "--chat-template",
            help="A Jinja file rendering chats instead of the checkpoint's, or a built-in: "
            "deepseek_v3_tools, deepseek_v31_tools (DeepSeek's templates writing `tools` too).",
        ),
        tool_call_parser: str | None = typer.Option(
            None,
            "--tool-call-parser",
            help="Read tool calls from the output: deepseek_v3 (V3, R1), deepseek_v31 (V3.1, "
            "V3.2-Exp) or deepseek_v32 (V3.2).",
        ),
        enable_auto_tool_choice: bool = typer.Option(
            False,
            "--enable-auto-tool-choice",
            help='Allow tool_choice "auto" (the default with tools).',
        ),
        reasoning_parser: str | None = typer.Option(
            None,
            "--reasoning-parser",
            help="Split thinking into reasoning_content: deepseek_r1, or deepseek_v3 (V3.1 / V3.2: "
            "when chat_template_kwargs turn thinking on).",
        ),
        autoscale: bool = typer.Option(
            False,
            "--autoscale",
            help="Add and remove prefill/decode units with the load (target-utilisation rule).",
        ),
        min_prefill_units: int = typer.Option(1, "--min-prefill-units"),
        max_prefill_units: int = typer.Option(4, "--max-prefill-units"),
        min_decode_units: int = typer.Option(1, "--min-decode-units"),
        max_decode_units: int = typer.Option(4, "--max-decode-units"),
        autoscale_interval: str = typer.Option(
            "10s",
            "--autoscale-interval",
            metavar="DURATION",
            help="Time between autoscaling decisions, with a unit (us, ms, s): 10s.",
        ),
        autoscale_target: float = typer.Option(
            0.7, "--autoscale-target", help="Busy share units are sized for."
        ),
    ) -> None:
        """Serve a checkpoint behind an OpenAI-compatible API with prefill/decode units."""
        # Option values first: a typo fails at once, before the server's imports and processes.
        if model is not None:
            input_folder(model, "--model")
        if kv_cache_dir is not None:
            output_folder(kv_cache_dir, "--kv-cache-dir")
        if secret_file is not None:
            input_file(secret_file, "--secret-file")
        if chat_template is not None:
            from moeinfra.server.launch import chat_template_text

            chat_template_text(chat_template)
        drain_timeout_s = parse_duration_s(drain_timeout, "--drain-timeout")
        unit_timeout_s = parse_duration_s(unit_timeout, "--unit-timeout")
        kv_transfer_timeout_s = parse_duration_s(kv_transfer_timeout, "--kv-transfer-timeout")
        comm_delay_s = parse_duration_s(comm_delay, "--comm-delay")
        autoscale_interval_s = parse_duration_s(autoscale_interval, "--autoscale-interval")

        from moeinfra.engine.tiny import default_model
        from moeinfra.server.autoscale import AutoscalePolicy
        from moeinfra.server.launch import DISAGGREGATED, ServeOptions, default_layout, serve

        model_dir = model if model is not None else default_model()

        given = {
            "prefill_units": prefill_units,
            "prefill_ranks": prefill_ranks,
            "decode_units": decode_units,
            "decode_ranks": decode_ranks,
            "colocated_units": colocated_units,
            "colocated_ranks": colocated_ranks,
        }
        if all(v is None for v in given.values()):
            # autoscaling adds and drains prefill and decode units: it starts disaggregated
            layout = DISAGGREGATED if autoscale else default_layout(device)
        else:
            layout = {k: DISAGGREGATED[k] if v is None else v for k, v in given.items()}

        policy = (
            AutoscalePolicy(
                (min_prefill_units, max_prefill_units),
                (min_decode_units, max_decode_units),
                autoscale_interval_s,
                autoscale_target,
            )
            if autoscale
            else None
        )

        options = ServeOptions(
            model=model,
            host=host,
            port=port,
            **layout,
            control=control,
            kv_host=kv_host,
            kv_connector=kv_connector,
            kv_cache_dir=kv_cache_dir,
            kv_cache_bytes=kv_cache_bytes,
            engine=_engine_config(
                model_dir,
                num_kv_blocks,
                kv_cache_memory_bytes,
                memory_utilization,
                block_size,
                max_num_seqs,
                max_num_batched_tokens,
                dtype,
                redundant_experts,
                eplb_interval,
                overlap,
                device,
                speculative_tokens,
            ),
            served_model_name=served_model_name,
            max_queue=max_queue,
            max_model_len=max_model_len,
            drain_timeout_s=drain_timeout_s,
            unit_timeout_s=unit_timeout_s,
            kv_transfer_timeout_s=kv_transfer_timeout_s,
            comm_delay_s=comm_delay_s,
            noop_model=noop_model,
            cpu_threads=cpu_threads,
            secret_file=secret_file,
            insecure=insecure,
            max_request_bytes=max_request_bytes,
            metric_names=metric_names,
            chat_template=chat_template,
            tool_call_parser=tool_call_parser,
            enable_auto_tool_choice=enable_auto_tool_choice,
            reasoning_parser=reasoning_parser,
            autoscale=policy,
        )
        code = serve(options, announce=lambda line: print(line, file=sys.stderr, flush=True))
        raise typer.Exit(code)

    @app.command()
    def unit(
        server: str = typer.Option(..., "--server", help="The server's control address."),
        role: str = typer.Option(..., "--role", help="prefill, decode or colocated."),
        ranks: int = typer.Option(2, "--ranks", help="Ranks (EP degree) of this unit."),
        model: Path | None = _MODEL,
        kv_host: str | None = typer.Option(
            None,
            "--kv-host",
            help="This host's address for incoming KV (decode; prefill with --kv-connector "
            "mooncake: where decode ranks read it). Default: its address on the route to --server.",
        ),
        kv_connector: str = _CONNECTOR,
        kv_cache_dir: Path | None = typer.Option(None, "--kv-cache-dir"),
        kv_cache_bytes: int = _CACHE_BYTES,
        unit_id: str | None = typer.Option(None, "--unit-id", help="Default: role-random."),
        parent_pid: int | None = typer.Option(
            None, "--parent-pid", help="Exit when this process is gone."
        ),
        num_kv_blocks: int | None = _BLOCKS,
        kv_cache_memory_bytes: int | None = _KV_MEMORY,
        memory_utilization: float = _UTILIZATION,
        block_size: int | None = _BLOCK,
        max_num_seqs: int = _SEQS,
        max_num_batched_tokens: int = _TOKENS,
        dtype: str = _DTYPE,
        device: str = _DEVICE,
        redundant_experts: int = _REDUNDANT,
        eplb_interval: int = _EPLB,
        overlap: str = _OVERLAP,
        speculative_tokens: int = _SPECULATIVE,
        comm_delay: str = _DELAY,
        noop_model: bool = _NOOP,
        cpu_threads: int | None = _THREADS,
        secret_file: Path | None = _SECRET,
        insecure: bool = _INSECURE,
        nproc_per_node: int | None = typer.Option(
            None,
            "--nproc-per-node",
            help="Ranks on this host when the unit spans hosts (default: all --ranks).",
        ),
        node_rank: int = typer.Option(
            0, "--node-rank", help="0 on the host of --master-addr (it hosts the rendezvous)."
        ),
        max_restarts: int = typer.Option(
            0,
            "--max-restarts",
            help="Times torch's elastic agent starts every rank of the unit again after one "
            "fails (on every host of the unit; each start rejoins the server).",
        ),
        master_addr: str | None = typer.Option(
            None, "--master-addr", help="Host of the unit's rank 0 (a unit spanning hosts)."
        ),
        master_port: int | None = typer.Option(
            None, "--master-port", help="Free port on --master-addr where the ranks meet."
        ),
    ) -> None:
        """Run one unit of engine ranks that joins a running server (on this or another host;
        torchrun's --nproc-per-node / --node-rank / --master-addr / --master-port spread one unit
        over several hosts, each running this command with the same --unit-id)."""
        comm_delay_s = parse_duration_s(comm_delay, "--comm-delay")  # before the heavy imports
        import uuid

        from moeinfra.engine.tiny import default_model
        from moeinfra.errors import InputError
        from moeinfra.server.unit import ROLES, UnitSpec, run_unit

        if role not in ROLES:
            raise InputError(f"--role={role!r} must be one of {', '.join(ROLES)}")
        if ranks < 1:
            raise InputError(f"--ranks={ranks} must be >= 1")
        if max_restarts < 0:
            raise InputError(f"--max-restarts={max_restarts} must be >= 0")
        if cpu_threads is not None and cpu_threads < 1:
            raise InputError(f"--cpu-threads={cpu_threads} must be >= 1")
        if not server.startswith("tcp://") or ":" not in server[6:]:
            raise InputError(f"--server={server!r} must be a ZeroMQ address like tcp://HOST:PORT")
        from moeinfra.server.secret import check_exposure, read_secret
        from moeinfra.server.unit import address_toward, check_drafting

        keys = read_secret(input_file(secret_file, "--secret-file")) if secret_file else None
        from moeinfra.server.kv_connector import check_connector

        check_connector(kv_connector, secret_file)
        # peers on other hosts reach this host's KV address: decode ranks take hand-offs there,
        # prefill ranks lend their blocks there to a connector that reads them
        kv_served = role == "decode" or (role == "prefill" and kv_connector != "zmq")
        if kv_served and kv_host is not None:
            check_exposure({"--kv-host": kv_host}, keys, insecure)
        here = ranks if nproc_per_node is None else nproc_per_node
        rendezvous = _rendezvous(ranks, here, node_rank, master_addr, master_port, unit_id)
        model_dir = input_folder(model, "--model") if model is not None else default_model()
        if kv_cache_dir is not None:
            output_folder(kv_cache_dir, "--kv-cache-dir")
        engine = _engine_config(
            model_dir,
            num_kv_blocks,
            kv_cache_memory_bytes,
            memory_utilization,
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            dtype,
            redundant_experts,
            eplb_interval,
            overlap,
            device,
            speculative_tokens,
        )
        check_drafting(model_dir, engine.num_speculative_tokens)
        if kv_served and kv_host is None:
            # ranks on other hosts reach this one's KV: a loopback address would be their own
            kv_host = address_toward(server)
            check_exposure({"--kv-host": kv_host}, keys, insecure)
        spec = UnitSpec(
            unit_id=unit_id or f"{role}-{uuid.uuid4().hex[:6]}",
            role=role,
            ranks=ranks,
            server=server,
            model_dir=str(model_dir),
            engine=engine,
            kv_host=kv_host or "127.0.0.1",
            kv_connector=kv_connector,
            disk_cache_dir=str(kv_cache_dir) if kv_cache_dir else None,
            disk_cache_bytes=kv_cache_bytes,
            comm_delay_s=comm_delay_s,
            noop_model=noop_model,
            node_rank=node_rank,
            max_restarts=max_restarts,
            local_ranks=here,
            rendezvous=rendezvous,
            threads=cpu_threads,
            secret_file=str(secret_file) if secret_file else None,
        )
        raise typer.Exit(run_unit(spec, parent_pid=parent_pid))

    @app.command("calibrate")
    def calibrate(
        url: str | None = typer.Option(
            None, "--url", help="A live moeinfra server to probe and fit (serve up)."
        ),
        measurements: Path | None = typer.Option(
            None, "--measurements", help="Or a JSON file of measured steps to fit (see docs)."
        ),
        name: str | None = typer.Option(None, "--name", help="The calibration's name."),
        out: Path = typer.Option(
            Path("calibration.json"), "--out", "-o", help="Where to write the calibration."
        ),
        seed: int = typer.Option(0, "--seed", help="Probe prompts' seed."),
        quiet: bool = typer.Option(False, "--quiet", "-q"),
    ) -> None:
        """Fit the serving model's factors to measured step times (a live server's engine steps
        or a measurements file) and write a calibration for serve model/simulate/plan."""
        import json

        from tqdm import tqdm

        from moeinfra.errors import InputError

        if (url is None) == (measurements is None):
            raise InputError("give exactly one of --url (a live server) and --measurements FILE")
        output_file(out, "--out")
        if measurements is not None:
            input_file(measurements, "--measurements")
        if url is not None:
            from moeinfra.server.calibrate import calibrate_live

            bar = tqdm(desc="probe waves", disable=quiet or not sys.stderr.isatty())
            try:
                calibration = calibrate_live(
                    url, name=name, seed=seed, progress=lambda: bar.update(1)
                )
            finally:
                bar.close()
        else:
            from moeinfra.serving.calibration import fit_measurements

            calibration = fit_measurements(measurements, name)
        calibration.save(out)
        typer.echo(json.dumps(calibration.summary() | {"written": str(out)}, indent=1))

    @app.command()
    def bench(
        url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The server."),
        workload: str = typer.Option(
            "synthetic", "--workload", help="synthetic, or a Mooncake-style .jsonl trace."
        ),
        rate: float | None = typer.Option(
            None,
            "--rate",
            help="Poisson arrivals, requests/s (inf: all at once). Default: the trace's "
            "timestamps, or 4/s for synthetic.",
        ),
        num_requests: int = typer.Option(
            64, "--num-requests", "-n", help="Synthetic requests, or the trace's first N."
        ),
        block_tokens: int = typer.Option(
            512, "--block-tokens", help="Tokens per trace hash_id block."
        ),
        vocab: int = typer.Option(1000, "--vocab", help="Token ids drawn from 1..vocab-1."),
        max_concurrency: int | None = typer.Option(
            None,
            "--max-concurrency",
            help="At most this many requests in flight; a request due while they are waits "
            "(not counted in its TTFT). Default: no limit.",
        ),
        seed: int = typer.Option(
            0,
            "--seed",
            help="Draws the arrivals (--rate) and the prompts' tokens: a second run with the same "
            "seed on the same server finds the first run's prompts in its prefix caches.",
        ),
        out: Path = typer.Option(Path("bench"), "--out", "-o", help="Folder for JSON + figure."),
        quiet: bool = typer.Option(False, "--quiet", "-q"),
    ) -> None:
        """Replay a workload against a live server: TTFT/TPOT/ITL percentiles, throughput,
        cache hit rate, errors (bench.json, bench.png)."""
        import asyncio
        import json

        from tqdm import tqdm

        from moeinfra.atomicio import write_text_atomic
        from moeinfra.errors import InputError
        from moeinfra.server import bench as b

        if vocab < 2:
            raise InputError(f"--vocab={vocab} must be >= 2")
        if max_concurrency is not None and max_concurrency < 1:
            raise InputError(f"--max-concurrency={max_concurrency} must be >= 1")
        if workload != "synthetic":
            input_file(Path(workload), "--workload", "allowed: synthetic or a .jsonl trace")
        output_folder(out, "--out")
        if workload == "synthetic":
            requests = b.synthetic_requests(num_requests, vocab=vocab, seed=seed)
            b.poisson_arrivals(requests, 4.0 if rate is None else rate, seed)
        else:
            requests = b.trace_requests(
                workload, vocab=vocab, block_tokens=block_tokens, limit=num_requests, seed=seed
            )
            if rate is not None:
                b.poisson_arrivals(requests, rate, seed)
        bar = tqdm(total=len(requests), unit="req", disable=quiet or not sys.stderr.isatty())
        try:
            results, wall = asyncio.run(
                b.replay(
                    url,
                    requests,
                    progress=lambda: bar.update(1),
                    max_concurrency=max_concurrency,
                )
            )
        finally:
            bar.close()
        summary = b.summarize(results, wall)
        summary["workload"] = workload
        summary["max_concurrency"] = max_concurrency
        per_request = [
            {
                "arrival_s": r.arrival_s,
                "sent_s": r.sent_s,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "cached_tokens": r.cached_tokens,
                "ttft_s": r.ttft_s,
                "tpot_s": r.tpot_s,
                "latency_s": r.latency_s,
                "error": r.error,
            }
            for r in results
        ]
        write_text_atomic(
            out / "bench.json", json.dumps({"summary": summary, "requests": per_request}, indent=1)
        )
        b.plot(results, out / "bench.png", title=f"serve bench ({workload})")
        typer.echo(json.dumps(summary, indent=1))


def _rendezvous(
    ranks: int,
    here: int,
    node_rank: int,
    master_addr: str | None,
    master_port: int | None,
    unit_id: str | None,
) -> str | None:
    """The unit's process-group address when it spans hosts (None: all its ranks run here)."""
    from moeinfra.errors import InputError

    if not 1 <= here <= ranks:
        raise InputError(f"--nproc-per-node={here} must be between 1 and --ranks={ranks}")
    if here == ranks:
        if node_rank != 0:
            raise InputError(
                f"--node-rank={node_rank}: with every rank on this host it must be 0 "
                "(give --nproc-per-node to spread the unit over hosts)"
            )
        return None
    if ranks % here:
        raise InputError(
            f"--nproc-per-node={here} must divide --ranks={ranks}: every host of a unit runs "
            "as many ranks"
        )
    if not 0 <= node_rank < ranks // here:
        raise InputError(
            f"--node-rank={node_rank} must be between 0 and {ranks // here - 1} (--ranks={ranks} "
            f"at --nproc-per-node={here} is {ranks // here} hosts)"
        )
    if master_addr is None or master_port is None or unit_id is None:
        raise InputError(
            f"--nproc-per-node={here} < --ranks={ranks} spreads the unit over hosts: give "
            "--master-addr, --master-port and the same --unit-id on every host"
        )
    if not 0 < master_port < 65536:
        raise InputError(f"--master-port={master_port} must be between 1 and 65535")
    return f"tcp://{master_addr}:{master_port}"
