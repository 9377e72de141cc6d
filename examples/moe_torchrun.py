"""Expert-parallel DeepSeek-V3 MoE decoder under ``torchrun`` (GPUs with NCCL, or CPUs with gloo).

One process per GPU; every rank holds its own tokens (data-parallel attention) and ``(E + R) / N``
expert slots placed by EPLB. Not run in CI. ::

    torchrun --nproc-per-node 8 examples/moe_torchrun.py --tokens 4096 --redundant 8 --overlap prefill
    torchrun --nproc-per-node 2 examples/moe_torchrun.py --backend gloo --tokens 256 --overlap decode

``moeinfra moe run --world-size N ...`` runs the same on local gloo processes without torchrun.

Every rank builds the full reference decoder (to check its output), so ``--preset deepseek_v3`` needs
46 GB of float32 weights per process; on GPUs the recorded intervals are host-side (launch) times.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from moeinfra.eplb import LoadEstimator, evaluate, rebalance
from moeinfra.moe.block import build_decoder
from moeinfra.moe.comm import Communicator
from moeinfra.moe.config import preset
from moeinfra.moe.run import segments_for
from moeinfra.moe.runtime import ExpertParallelDecoder
from moeinfra.moe.timeline import Recorder, overlap, write_chrome_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--redundant", type=int, default=0)
    parser.add_argument("--overlap", default="prefill", choices=["none", "prefill", "decode"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trace", default=None, help="Chrome-trace JSON written by rank 0")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    config = preset(args.preset)
    decoder = build_decoder(config, seed=0).to(device)
    slots = config.num_routed_experts + args.redundant
    uniform = np.ones((config.num_layers, config.num_routed_experts))
    plan = rebalance(uniform, slots, config.num_expert_groups, 1, world)
    recorder = Recorder(rank=rank, enabled=False)
    model = ExpertParallelDecoder(decoder, plan, Communicator(recorder=recorder))
    g = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(args.tokens, config.hidden_size, generator=g).to(device)
    segments = segments_for(args.tokens, args.seq_len)

    model.set_record_load(True)
    out = model(x, segments, args.overlap)
    model.set_record_load(False)
    load = np.stack([layer.take_load(all_reduce=True).numpy() for layer in model.moe])
    with torch.no_grad():
        err = torch.tensor((out - decoder(x, segments)).abs().max().item(), device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)

    times = []
    for _ in range(args.steps):
        recorder.clear()
        recorder.enabled = True
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(x, segments, args.overlap)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        recorder.enabled = False
    estimator = LoadEstimator(config.num_layers, config.num_routed_experts, window=1)
    estimator.record(load)
    new_plan = rebalance(estimator.load(), slots, config.num_expert_groups, 1, world)
    moved = model.apply_plan(new_plan)
    events = [None] * world
    dist.all_gather_object(events, recorder.events)
    if rank == 0:
        ov = overlap(recorder.events)
        print(f"max abs error vs reference: {float(err):.3g}")
        print(f"median step time: {np.median(times) * 1e3:.2f} ms (rank 0)")
        print(
            f"balancedness before/after EPLB: {evaluate(plan, load).summary()['balancedness']:.4f}"
            f" / {evaluate(new_plan, load).summary()['balancedness']:.4f}"
        )
        print(f"communication hidden (rank 0, host-side intervals): {ov.hidden_fraction}")
        print(f"experts received by rank 0 during migration: {moved}")
        if args.trace:
            print(f"trace: {write_chrome_trace(args.trace, events)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
