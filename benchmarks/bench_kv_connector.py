"""One KV hand-off through each connector, on this host's loopback.

A prompt's KV of ``--tokens`` tokens in the "latent" checkpoint's layout (bench_vs_vllm: 4 layers
of DeepSeek-V3's MLA latent + RoPE widths, 576 values, float32; 9.4 MB at 1,024 tokens) goes from
a lender to a reader, both in this process (one thread each, as a prefill rank's sender thread
and a decode rank's reader): ``zmq`` frames and check-sums the blocks and sends them behind the
header over a TCP ``PUSH``/``PULL`` pair; ``mooncake`` lends them in registered memory, sends the
header over the same pair, and the reader reads them with Mooncake's TCP transfer. Per hand-off:
the lender's seconds (what a prefill rank's sender thread spends) and the seconds from the start
of sending to the verified blocks on the reader's side. Medians of ``--repeats`` hand-offs after
two warm-ups.

    python -m benchmarks.bench_kv_connector          # ~10 s on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import zmq

from moeinfra.engine.handoff import Handoff
from moeinfra.engine.sampling import SamplingParams
from moeinfra.server.kv_connector import make_connector
from moeinfra.server.kv_transfer import verify
from moeinfra.server.messages import decode_kv_header

LAYERS, VALUES, BLOCK = 4, 576, 64


def one(connector_name: str, tokens: int, repeats: int) -> dict:
    lender, reader = make_connector(connector_name, "127.0.0.1"), None
    if lender.reads:
        reader = make_connector(connector_name, "127.0.0.1")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    kv = torch.randn(LAYERS, tokens, VALUES)
    lend_s, deliver_s = [], []
    for i in range(repeats + 2):
        rid = f"r{i}"
        handoff = Handoff(rid, list(range(tokens)), [1], SamplingParams(), kv, 0, "", [], None)
        began = time.perf_counter()
        frames = lender.frames(handoff, BLOCK)
        lent = time.perf_counter()
        push.send_multipart(frames, copy=False)
        got = pull.recv_multipart(copy=False)
        header = decode_kv_header(got[0].buffer)
        blocks = reader.fetch(header) if header.source else [f.buffer for f in got[1:]]
        arrival = verify(header, blocks, LAYERS, VALUES, torch.float32)
        done = time.perf_counter()
        lender.release(rid)
        assert torch.equal(arrival.preloaded.kv, kv)
        if i >= 2:
            lend_s.append(lent - began)
            deliver_s.append(done - began)
    for closing in (lender, reader):
        if closing is not None:
            closing.close()
    push.close(0)
    pull.close(0)
    ctx.term()
    return {
        "connector": connector_name,
        "megabytes": kv.numel() * 4 / 1e6,
        "lend_ms": 1e3 * statistics.median(lend_s),
        "deliver_ms": 1e3 * statistics.median(deliver_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    opts = parser.parse_args()
    print("| connector | prompt tokens | MB | lender (ms) | send to verified blocks (ms) |")
    print("|---|---:|---:|---:|---:|")
    for tokens in opts.tokens:
        for name in ("zmq", "mooncake"):
            r = one(name, tokens, opts.repeats)
            print(
                f"| {name} | {tokens:,} | {r['megabytes']:.1f} | {r['lend_ms']:.1f} | "
                f"{r['deliver_ms']:.1f} |"
            )


if __name__ == "__main__":
    main()
