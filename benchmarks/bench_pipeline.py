"""Pipeline runtime vs simulator: sleep-emulated stages on 4 gloo processes.

Each stage sleeps F in forward, B - W for the input gradient and W for the weight gradient (one unit
= 20 ms by default); its ``overlapped_forward_backward`` hook runs the pair one after the other. Every schedule runs through the same executor; its measured step time (median
of >= 5 steps after a warm-up, slowest rank) is compared with its own simulation under the
rendezvous model, with the nominal costs and with the stage's costs measured in-process (sleep
overshoot and autograd overhead included) plus the measured one-way p2p latency, so the ratio
isolates the executor's own overhead.

    .venv/bin/python -m benchmarks.bench_pipeline [--unit-ms 20] [--reps 5] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

RANKS = 4
COSTS_UNITS = {"F": 1.0, "B": 2.0, "W": 1.0}
H = 8
MB = 2


class _SleepInput(torch.autograd.Function):
    """Input path: forward sleeps F, backward sleeps B - W (the input-gradient part)."""

    @staticmethod
    def forward(ctx, x, f_s, i_s):
        ctx.i_s = i_s
        time.sleep(f_s)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.i_s)
        return g, None, None


class _SleepWeight(torch.autograd.Function):
    """Weight path: backward sleeps W; only reached when weight gradients are asked for."""

    @staticmethod
    def forward(ctx, w, w_s):
        ctx.w_s = w_s
        return w * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.w_s)
        return g, None


class SleepStage(nn.Module):
    def __init__(self, unit_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(H))
        self.f_s = COSTS_UNITS["F"] * unit_s
        self.i_s = (COSTS_UNITS["B"] - COSTS_UNITS["W"]) * unit_s
        self.w_s = COSTS_UNITS["W"] * unit_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepInput.apply(x, self.f_s, self.i_s) + _SleepWeight.apply(self.weight, self.w_s)

    @classmethod
    def overlapped_forward_backward(
        cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1
    ):
        """DeepSeek's hook, run one after the other: the pair starts when both of its inputs are
        there and takes F + B, which is what the simulator's F&B models."""
        from moeinfra.pipeline.runtime import run_backward

        outputs0 = [module0(*inputs0)]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
        else:
            run_backward(outputs1, output_grads1)
        return outputs0, loss0


def _criterion(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return (out * label).sum()


def _runner(name: str, rank: int, unit_s: float):
    from moeinfra.pipeline import runtime

    specs = [((MB, H), torch.float32)]
    if name == "dualpipe":
        return runtime.DualPipe((SleepStage(unit_s), SleepStage(unit_s)), p2p_specs=specs)
    if name == "dualpipev":
        return runtime.DualPipeV((SleepStage(unit_s), SleepStage(unit_s)), p2p_specs=specs)
    cls = {"gpipe": runtime.GPipe, "1f1b": runtime.OneFOneB, "zb1p": runtime.ZB1P}[name]
    return cls(SleepStage(unit_s), p2p_specs=specs)


def _args(name: str, rank: int, m: int) -> tuple[tuple, tuple]:
    # Inputs that need a gradient, so that the first stage's backward costs what the others' do.
    x, y = torch.randn(m * MB, H, requires_grad=True), torch.randn(m * MB, H)
    half_x, half_y = torch.randn(m // 2 * MB, H, requires_grad=True), torch.randn(m // 2 * MB, H)
    if name == "dualpipe":
        return ((half_x,), (half_y,)) if rank in (0, RANKS - 1) else ((), ())
    if name == "dualpipev":
        return ((x,), (y,)) if rank == 0 else ((), ())
    return ((x,) if rank == 0 else (), (y,) if rank == RANKS - 1 else ())


def _worker(
    rank: int, port: int, names: list[str], unit_s: float, reps: int, m: int, queue
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=RANKS,
        timeout=timedelta(seconds=120),
    )
    try:
        # One-way p2p latency (half a ping-pong between ranks 0 and 1), for the simulation.
        buf = torch.zeros(MB, H)
        trips = []
        for _ in range(30):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            trips.append((time.perf_counter() - t0) / 2)
        if rank == 0:
            queue.put(("latency", [statistics.median(trips)]))
        models = {name: _runner(name, rank, unit_s) for name in names}
        data = {name: _args(name, rank, m) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        # Round-robin over schedules, so that a burst of load on the shared machine hits all of them.
        for rep in range(reps + 1):
            for name in names:
                ins, labels = data[name]
                dist.barrier()
                t0 = time.perf_counter()
                models[name].step(*ins, num_chunks=m, criterion=_criterion, labels=labels)
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep > 0:  # the first round is a warm-up
                    times[name].append(float(elapsed))
        if rank == 0:
            for name in names:
                queue.put((name, times[name]))
    finally:
        dist.destroy_process_group()


def calibrate(unit_s: float, reps: int = 20) -> dict[str, float]:
    """Median seconds of one F, I, W and full B of :class:`SleepStage` in this process (sleep
    overshoot and autograd overhead included), so the simulation uses the stage's real costs."""
    torch.set_num_threads(1)
    stage = SleepStage(unit_s)
    from moeinfra.pipeline.runtime.weight_grad import backward_input, backward_weight

    f, i, w, b = [], [], [], []
    params = list(stage.parameters())
    for _ in range(reps):
        x = torch.randn(MB, H, requires_grad=True)
        y = stage(x)
        t0 = time.perf_counter()
        torch.autograd.backward([y], [torch.ones_like(y)])
        b.append(time.perf_counter() - t0)
        # The split as the executor runs it (graph walk and hooks included).
        x = torch.randn(MB, H, requires_grad=True)
        t0 = time.perf_counter()
        y = stage(x)
        t1 = time.perf_counter()
        _, deferred = backward_input([y], [torch.ones_like(y)], [x], params)
        t2 = time.perf_counter()
        backward_weight(deferred)
        t3 = time.perf_counter()
        f.append(t1 - t0)
        i.append(t2 - t1)
        w.append(t3 - t2)
    return {key: statistics.median(v) for key, v in (("F", f), ("I", i), ("W", w), ("B", b))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit-ms", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    if args.reps < 5:
        parser.error("--reps must be >= 5")

    from moeinfra.pipeline import Costs, generate, simulate

    names = ["gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    unit_s = args.unit_ms / 1000
    procs = [
        ctx.Process(
            target=_worker, args=(r, port, names, unit_s, args.reps, args.microbatches, queue)
        )
        for r in range(RANKS)
    ]
    for p in procs:
        p.start()
    measured = {}
    try:
        for _ in range(len(names) + 1):
            name, times = queue.get(timeout=600)
            measured[name] = times
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    nominal = Costs(**COSTS_UNITS)
    cal = calibrate(unit_s)
    ms = {k: v * 1000 for k, v in cal.items()}
    latency_ms = measured.pop("latency")[0] * 1000
    real = Costs(F=ms["F"], B=ms["B"], W=ms["W"], I=ms["I"], latency=latency_ms)
    print(
        f"{RANKS} gloo processes, {args.microbatches} micro-batches, F={COSTS_UNITS['F']:g} B={COSTS_UNITS['B']:g} "
        f"W={COSTS_UNITS['W']:g} units of {args.unit_ms:g} ms; measured stage costs F={real.F:.2f} B={real.B:.2f} "
        f"I={real.I:.2f} W={real.W:.2f} ms, p2p latency {latency_ms:.2f} ms; median of {args.reps} steps (slowest rank)\n"
    )
    print(
        "| schedule | stages | simulated, nominal costs (ms) | simulated, measured costs + latency (ms) | measured step (ms) | measured / simulated |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        sched = generate(name, RANKS, args.microbatches)
        nominal_ms = simulate(sched, nominal, comm="rendezvous").makespan * args.unit_ms
        sim_ms = simulate(sched, real, comm="rendezvous").makespan
        med_ms = statistics.median(measured[name]) * 1000
        print(
            f"| {name} | {sched.num_stages} | {nominal_ms:.1f} | {sim_ms:.1f} | {med_ms:.1f} | {med_ms / sim_ms:.3f} |"
        )


if __name__ == "__main__":
    main()
