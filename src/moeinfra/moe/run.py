"""End-to-end run of the expert-parallel decoder on ``N`` ranks: what ``moeinfra moe run`` does.

Each rank builds the same model (fixed seed), makes its own tokens, runs the expert-parallel decoder
with the chosen overlap schedule, compares its output with the single-process reference on the same
tokens and weights, records the per-expert load, rebalances with EPLB, migrates the expert weights and
checks the output again.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from moeinfra.errors import InputError
from moeinfra.moe.config import MoEConfig, preset
from moeinfra.moe.schedules import MODES

MAX_LOCAL_WEIGHT_GB = 8.0
"""Largest model (float32 weights per process) ``moeinfra moe run`` builds in local processes."""

TORCHRUN_TEMPLATE = (
    "torchrun --nproc-per-node {world_size} examples/moe_torchrun.py --backend gloo "
    "--preset {preset} --tokens {tokens} --redundant {redundant} --overlap {overlap}"
)


@dataclass(frozen=True)
class RunConfig:
    """One run. ``tokens``: tokens per rank (data-parallel attention: each rank has its own batch),
    cut into sequences of ``seq_len``. ``redundant``: extra physical expert slots per layer.
    ``delay_s``: injected delay per dispatch/combine exchange (see :mod:`moeinfra.moe.comm`).
    ``steps``: timed steps (the median and the spread are reported) after one warm-up step. The
    defaults (``small`` preset, 1,024 tokens per rank) are sized so that overlap has compute to hide
    an exchange of a few ms behind; with ``tiny`` at 256 tokens it has not (docs/benchmarks.md). ``bias_scale``: spread of
    the gate's selection bias, which makes the expert load uneven (so EPLB has work to do).
    ``layers``: decoder blocks (default: the preset's). ``overrides``: other ``MoEConfig`` fields to
    change, as ``(name, value)`` pairs."""

    world_size: int = 2
    preset: str = "small"
    tokens: int = 1024
    redundant: int = 0
    overlap: str = "none"
    delay_s: float = 0.0
    seq_len: int = 128
    steps: int = 7
    seed: int = 0
    bias_scale: float = 0.3
    layers: int | None = None
    overrides: tuple[tuple[str, object], ...] = ()
    trace: bool = False

    def model_config(self) -> MoEConfig:
        config = preset(self.preset)
        if self.layers is not None:
            config = config.replace(num_layers=self.layers)
        return config.replace(**dict(self.overrides)) if self.overrides else config

    def validate(self) -> MoEConfig:
        """Check the run before any process starts; return the model config."""
        config = self.model_config()
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise InputError(f"world_size={self.world_size!r} must be a positive integer")
        if self.tokens < 0:
            raise InputError(f"tokens={self.tokens} must be >= 0")
        if self.redundant < 0:
            raise InputError(f"redundant={self.redundant} must be >= 0")
        slots = config.num_routed_experts + self.redundant
        if slots % self.world_size:
            raise InputError(
                f"routed experts + redundant = {config.num_routed_experts} + {self.redundant} = "
                f"{slots} slots must be a multiple of world_size={self.world_size}"
            )
        if self.overlap not in MODES:
            raise InputError(
                f"overlap={self.overlap!r} is not allowed; use one of {', '.join(MODES)}"
            )
        if self.delay_s < 0:
            raise InputError(f"delay_s={self.delay_s} must be >= 0")
        if self.seq_len < 1:
            raise InputError(f"seq_len={self.seq_len} must be >= 1")
        if self.steps < 1:
            raise InputError(f"steps={self.steps} must be >= 1")
        weight_gb = config.parameter_count() * 4 / 1e9
        if weight_gb > MAX_LOCAL_WEIGHT_GB:
            raise InputError(
                f"preset={self.preset!r} needs {weight_gb:.0f} GB of float32 weights in every local "
                f"process (each rank also holds the single-process reference); the limit is "
                f"{MAX_LOCAL_WEIGHT_GB} GB: use preset 'tiny' here, or examples/moe_torchrun.py on GPUs"
            )
        return config

    def torchrun_command(self) -> str:
        return TORCHRUN_TEMPLATE.format(**asdict(self))


def segments_for(tokens: int, seq_len: int):
    """Cut ``tokens`` into sequences of ``seq_len`` (the last one shorter)."""
    from moeinfra.moe.mla import Segment

    return [
        Segment(i, 0, min(seq_len, tokens - start))
        for i, start in enumerate(range(0, tokens, seq_len))
    ]


def rank_inputs(config: MoEConfig, tokens: int, rank: int, seed: int):
    """This rank's hidden states ``[tokens, H]`` (deterministic in ``seed`` and ``rank``)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    return torch.randn(tokens, config.hidden_size, generator=g)


def run_rank(run: RunConfig) -> dict:
    """One rank's part of a run (inside an initialised process group). Returns plain data."""
    import torch
    import torch.distributed as dist

    from moeinfra.eplb import LoadEstimator, evaluate, rebalance
    from moeinfra.moe.block import build_decoder
    from moeinfra.moe.comm import Communicator
    from moeinfra.moe.runtime import ExpertParallelDecoder
    from moeinfra.moe.timeline import Recorder, overlap

    config = run.validate()
    rank, world = dist.get_rank(), dist.get_world_size()
    decoder = build_decoder(config, run.seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(run.seed + 7)
        for block in decoder.blocks:
            block.moe.gate.bias.copy_(
                torch.randn(config.num_routed_experts, generator=g) * run.bias_scale
            )
    num_slots = config.num_routed_experts + run.redundant
    layers = config.num_layers
    uniform = np.ones((layers, config.num_routed_experts))
    plan0 = rebalance(uniform, num_slots, config.num_expert_groups, 1, world)
    recorder = Recorder(rank=rank, enabled=False)
    comm = Communicator(delay_s=run.delay_s, recorder=recorder)
    model = ExpertParallelDecoder(decoder, plan0, comm)
    x = rank_inputs(config, run.tokens, rank, run.seed)
    segments = segments_for(run.tokens, run.seq_len)
    reference = decoder(x, segments).detach() if run.tokens else x.clone()

    def error(out: torch.Tensor) -> float:
        value = torch.tensor((out - reference).abs().max().item() if out.numel() else 0.0)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    # Warm-up step, with load recording: the load EPLB balances.
    model.set_record_load(True)
    out = model(x, segments, run.overlap)
    model.set_record_load(False)
    load = np.stack([layer.take_load(all_reduce=True).numpy() for layer in model.moe])
    estimator = LoadEstimator(layers, config.num_routed_experts, window=1)
    estimator.record(load)
    err_before = error(out)

    times, slowest, events = [], [], []
    for _ in range(run.steps):
        recorder.clear()
        recorder.enabled = True
        dist.barrier()
        start = time.perf_counter()
        model(x, segments, run.overlap)
        times.append(time.perf_counter() - start)
        recorder.enabled = False
        events = list(recorder.events)
        step = torch.tensor(times[-1], dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        slowest.append(float(step))
    ov = overlap(events)

    plan1 = rebalance(estimator.load(), num_slots, config.num_expert_groups, 1, world)
    received = model.apply_plan(plan1)
    err_after = error(model(x, segments, run.overlap))
    comm.close()
    return {
        "rank": rank,
        "time_s": statistics.median(times),
        "step_times_s": slowest,
        "max_abs_error_vs_reference": err_before,
        "max_abs_error_after_rebalance": err_after,
        "expert_load": load.tolist(),
        "balancedness_before": float(evaluate(plan0, load).summary()["balancedness"]),
        "balancedness_after": float(evaluate(plan1, load).summary()["balancedness"]),
        "experts_received": received,
        "compute_s": ov.compute_s,
        "comm_s": ov.comm_s,
        "overlap_s": ov.overlap_s,
        "events": events if run.trace else None,
    }


def run(run: RunConfig, *, trace_path=None, timeout_s: float = 300.0) -> dict:
    """Launch ``run.world_size`` local gloo ranks and summarise (the CLI's ``--json`` fields).

    Returns ``world_size, tokens, overlap, max_abs_error_vs_reference, per_rank_time_s`` (median
    per rank), ``step_times_s`` (the slowest rank's time of every timed step), ``step_time_s`` (their
    median), ``expert_load ([L][E], summed over ranks), balancedness_before, balancedness_after,
    comm_hidden_fraction`` (|comm ∩ compute| / |comm| summed over ranks; None without communication)
    and more. Writes a Chrome trace to ``trace_path`` when given.
    """
    from dataclasses import replace

    from moeinfra.moe.launch import launch

    run.validate()
    if trace_path is not None:
        run = replace(run, trace=True)
    ranks = launch(run.world_size, run_rank, (run,), timeout_s=timeout_s)
    comm_s = sum(r["comm_s"] for r in ranks)
    summary = {
        "world_size": run.world_size,
        "preset": run.preset,
        "tokens": run.tokens,
        "redundant": run.redundant,
        "overlap": run.overlap,
        "delay_s": run.delay_s,
        "max_abs_error_vs_reference": max(r["max_abs_error_vs_reference"] for r in ranks),
        "max_abs_error_after_rebalance": max(r["max_abs_error_after_rebalance"] for r in ranks),
        "per_rank_time_s": [r["time_s"] for r in ranks],
        "step_times_s": ranks[0]["step_times_s"],
        "step_time_s": statistics.median(ranks[0]["step_times_s"]),
        "expert_load": ranks[0]["expert_load"],
        "balancedness_before": ranks[0]["balancedness_before"],
        "balancedness_after": ranks[0]["balancedness_after"],
        "experts_migrated": sum(r["experts_received"] for r in ranks),
        "comm_hidden_fraction": (sum(r["overlap_s"] for r in ranks) / comm_s)
        if comm_s > 0
        else None,
        "per_rank_comm_hidden_fraction": [
            (r["overlap_s"] / r["comm_s"]) if r["comm_s"] > 0 else None for r in ranks
        ],
        "torchrun_command": run.torchrun_command(),
    }
    if trace_path is not None:
        from moeinfra.moe.timeline import write_chrome_trace

        summary["trace"] = str(write_chrome_trace(trace_path, [r["events"] for r in ranks]))
    return summary


def measure_rank(
    run: RunConfig, modes: tuple[str, ...], delays_s: tuple[float, ...], reps: int
) -> dict:
    """Step times of every (mode, delay) on this rank, interleaved over ``reps`` repetitions.

    Each step starts after a barrier; its time is the slowest rank's (all-reduced max). Returns
    ``{"mode/delay": {"times_s", "compute_s", "comm_s", "overlap_s"}}``, each a list over the
    repetitions (``compute_s`` / ``comm_s`` / ``overlap_s``: this rank's interval sums).
    """
    import torch
    import torch.distributed as dist

    from moeinfra.eplb import rebalance
    from moeinfra.moe.block import build_decoder
    from moeinfra.moe.comm import Communicator
    from moeinfra.moe.runtime import ExpertParallelDecoder
    from moeinfra.moe.timeline import Recorder, overlap

    config = run.validate()
    rank, world = dist.get_rank(), dist.get_world_size()
    decoder = build_decoder(config, run.seed)
    load = np.ones((config.num_layers, config.num_routed_experts))
    plan = rebalance(
        load, config.num_routed_experts + run.redundant, config.num_expert_groups, 1, world
    )
    recorder = Recorder(rank=rank)
    comm = Communicator(recorder=recorder)
    model = ExpertParallelDecoder(decoder, plan, comm)
    x = rank_inputs(config, run.tokens, rank, run.seed)
    segments = segments_for(run.tokens, run.seq_len)
    results: dict[str, dict[str, list[float]]] = {}
    for mode in modes:  # warm-up
        model(x, segments, mode)
    for _ in range(reps):
        for mode in modes:
            for delay in delays_s:
                comm.delay_s = delay
                recorder.clear()
                dist.barrier()
                start = time.perf_counter()
                model(x, segments, mode)
                elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                ov = overlap(recorder.events)
                entry = results.setdefault(
                    f"{mode}/{delay}",
                    {"times_s": [], "compute_s": [], "comm_s": [], "overlap_s": []},
                )
                entry["times_s"].append(float(elapsed))
                entry["compute_s"].append(ov.compute_s)
                entry["comm_s"].append(ov.comm_s)
                entry["overlap_s"].append(ov.overlap_s)
    comm.close()
    return results
