"""What a KV hand-off costs a prefill rank's step path.

A prefill rank (bench_vs_vllm's "latent" checkpoint: DeepSeek-V3's MLA widths, 4 layers,
float32) runs in this process behind its real sockets: a ZeroMQ control connection to a ``ROUTER``
standing in for the API server, and ``PUSH`` connections to a decode rank's ``PULL`` socket that a
thread here drains. ``--requests`` prompts of ``--prompt-tokens`` tokens arrive at once, each to be
handed off after its first token. For every step that hands prompts off: the engine step's seconds
(``EngineCore.step``: the forward, and the gather of each finished prompt's KV out of the paged
cache) and the seconds ``RankServer.emit`` then holds the loop before the next step may start
(framing, the per-block CRC-32 and queueing on the socket, unless a sender thread does them).
Medians over those steps, ``--runs`` runs; ``emit / step`` is how much the previous hand-off
delays the next prefill step.

    python -m benchmarks.bench_handoff            # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import zmq

from benchmarks.bench_vs_vllm import LATENT
from moeinfra.engine import SamplingParams
from moeinfra.engine.config import EngineConfig
from moeinfra.engine.core import EngineCore
from moeinfra.engine.tiny import init_tiny
from moeinfra.server.unit import RankServer, UnitSpec


def drain(pull, stop: threading.Event, received: list[int]) -> None:
    """The decode rank's side: take every hand-off's frames, count their bytes."""
    while not stop.is_set():
        if pull.poll(50):
            frames = pull.recv_multipart(copy=False)
            received[0] += sum(f.buffer.nbytes for f in frames[1:])


def one_run(core: EngineCore, server: RankServer, target: str, args, run: int) -> list[tuple]:
    """``(step s, emit s, prompts handed off)`` of every step that handed prompts off."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        prompt = [(7 * i + 13 * run + t) % 1000 + 3 for t in range(args.prompt_tokens)]
        core.add_request(f"r{run}-{i}", prompt, params, handoff=target)
    rows = []
    while core.has_work:
        began = time.perf_counter()
        outputs = core.step(core.overlap_mode(core.has_prefill()))
        stepped = time.perf_counter()
        handed = len(core.handoffs)
        server.emit(outputs)
        if handed:
            rows.append((stepped - began, time.perf_counter() - stepped, handed))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "latent", config=LATENT)
        ctx = zmq.Context()
        api = ctx.socket(zmq.ROUTER)
        control = f"tcp://127.0.0.1:{api.bind_to_random_port('tcp://127.0.0.1')}"
        pull = ctx.socket(zmq.PULL)
        target = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        stop, received = threading.Event(), [0]
        thread = threading.Thread(target=drain, args=(pull, stop, received), daemon=True)
        thread.start()
        config = EngineConfig(max_num_batched_tokens=4096, num_kv_blocks=2048, block_size=16)
        spec = UnitSpec("prefill-bench", "prefill", 1, control, str(model), config)
        core = EngineCore(model, config)
        core.warm_up()
        server = RankServer(spec, 0, core, "bench")
        rows = []
        for run in range(args.runs):
            rows += one_run(core, server, target, args, run)
        server.close()
        stop.set()
        thread.join()
        api.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    step_s = statistics.median(r[0] for r in rows)
    emit_s = statistics.median(r[1] for r in rows)
    per_prompt = statistics.median(r[1] / r[2] for r in rows)
    mb = received[0] / 2**20 / (args.runs * args.requests)
    print(
        f"{args.requests} requests x {args.prompt_tokens} prompt tokens, {args.runs} runs, "
        f"{len(rows)} steps with hand-offs, {mb:.1f} MiB of KV per prompt"
    )
    print(
        f"median step {step_s * 1e3:.1f} ms; emit after it {emit_s * 1e3:.2f} ms "
        f"({per_prompt * 1e3:.2f} ms per prompt handed off): {emit_s / step_s:.1%} of the step"
    )


if __name__ == "__main__":
    main()
