"""Expert-parallel MoE step time with and without dual micro-batch overlap, injected network delay.

Run: ``.venv/bin/python -m benchmarks.bench_moe [--reps 9] [--delays-ms 2 4 8] [--worlds 2 4]``
(defaults: ``moeinfra moe run``'s — the ``small`` preset, 1,024 tokens per rank in sequences of 128;
``--preset tiny --tokens 256 --seq-len 64`` is the regime where overlap does not pay).

Each world size is one set of spawned gloo ranks. Every exchange (dispatch or combine payload)
completes ``delay`` after gloo delivers it (``moeinfra.moe.comm``): the compute thread cannot use the
data before then, so only compute issued in between can hide it. Modes and delays are interleaved
inside each repetition; a step's time is the slowest rank's; medians (and quartiles) over the
repetitions.

Measures:
- ``saved / injected``: (T(none, d) - T(mode, d)) / (exchanges of none x d) — how much of the delay
  ``none`` pays the overlapped step does not (target: at least half);
- ``injected hidden``: 1 - (T(mode, d) - T(mode, 0)) / (exchanges of mode x d);
- ``comm hidden (timeline)``: |comm ∩ compute| / |comm| on the recorded intervals (all communication,
  the layout exchange and gloo's own time included), mean over ranks;
- the overlap's own cost without delay: step time split into compute (sum of the recorded compute
  intervals, rank 0) and the rest (waiting for exchanges, thread hand-offs, scheduling).
"""

from __future__ import annotations

import argparse
import statistics

from moeinfra.moe.config import preset
from moeinfra.moe.launch import launch
from moeinfra.moe.run import RunConfig, measure_rank
from moeinfra.moe.schedules import schedule

MODES = ("none", "prefill", "decode")


def _quartiles_ms(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1 * 1e3, q2 * 1e3, q3 * 1e3


def bench_world(run: RunConfig, delays_s: tuple[float, ...], reps: int) -> dict:
    """``{"mode/delay": {...}}`` of rank 0 plus every rank's timeline fractions."""
    layers = run.model_config().num_layers
    ranks = launch(
        run.world_size, measure_rank, (run, MODES, (0.0, *delays_s), reps), timeout_s=900
    )
    exchanges = {
        m: sum(op.kind in ("DISPATCH", "COMBINE") for op in schedule(m, layers)) for m in MODES
    }
    rows = []
    for delay in delays_s:
        none_t = statistics.median(ranks[0][f"none/{delay}"]["times_s"])
        for mode in MODES:
            times = ranks[0][f"{mode}/{delay}"]["times_s"]
            t = statistics.median(times)
            t0 = statistics.median(ranks[0][f"{mode}/0.0"]["times_s"])
            fractions = []
            for r in ranks:
                entry = r[f"{mode}/{delay}"]
                pairs = zip(entry["overlap_s"], entry["comm_s"], strict=True)
                fractions.append(statistics.median(o / c if c else 0.0 for o, c in pairs))
            rows.append(
                {
                    "delay_ms": delay * 1e3,
                    "mode": mode,
                    "quartiles_ms": _quartiles_ms(times),
                    "saved_ms": (none_t - t) * 1e3,
                    "saved_share": (none_t - t) / (exchanges["none"] * delay),
                    "injected_hidden": 1 - (t - t0) / (exchanges[mode] * delay),
                    "timeline_hidden": statistics.fmean(fractions),
                }
            )
    cost = []
    for mode in MODES:
        entry = ranks[0][f"{mode}/0.0"]
        step = statistics.median(entry["times_s"])
        compute = statistics.median(entry["compute_s"])
        cost.append(
            {
                "mode": mode,
                "quartiles_ms": _quartiles_ms(entry["times_s"]),
                "compute_ms": compute * 1e3,
                "rest_ms": (step - compute) * 1e3,
                "compute_ops": sum(
                    op.kind not in ("DISPATCH", "COMBINE") for op in schedule(mode, layers)
                ),
            }
        )
    return {"rows": rows, "cost": cost}


def main(argv: list[str] | None = None) -> None:
    defaults = RunConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--preset", default=defaults.preset)
    parser.add_argument("--tokens", type=int, default=defaults.tokens)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--layers", type=int, default=None, help="default: the preset's")
    args = parser.parse_args(argv)
    config = preset(args.preset)
    layers = args.layers or config.num_layers
    print(
        f"preset {args.preset} (expert width {config.moe_intermediate_size}), {layers} layers, "
        f"{args.tokens} tokens/rank in sequences of {args.seq_len}, medians [quartiles] of "
        f"{args.reps} repetitions\n"
    )
    delays = tuple(d / 1e3 for d in args.delays_ms)
    for world in args.worlds:
        run = RunConfig(
            world_size=world,
            preset=args.preset,
            tokens=args.tokens,
            seq_len=args.seq_len,
            layers=args.layers,
            redundant=world,
        )
        result = bench_world(run, delays, args.reps)
        print(
            f"{world} ranks, injected delay per exchange\n\n"
            "| delay (ms) | overlap | step (ms) | saved vs none (ms) | saved / injected into none | "
            "injected hidden | comm hidden (timeline) |\n|---|---|---|---|---|---|---|"
        )
        for r in result["rows"]:
            q1, q2, q3 = r["quartiles_ms"]
            print(
                f"| {r['delay_ms']:g} | {r['mode']} | {q2:.1f} [{q1:.1f}-{q3:.1f}] | "
                f"{r['saved_ms']:.1f} | {r['saved_share']:.0%} | {r['injected_hidden']:.0%} | "
                f"{r['timeline_hidden']:.0%} |"
            )
        print(
            f"\n{world} ranks, no delay: the overlap's own cost\n\n"
            "| overlap | step (ms) | compute ops | compute (ms) | not compute (ms) |\n|---|---|---|---|---|"
        )
        for c in result["cost"]:
            q1, q2, q3 = c["quartiles_ms"]
            print(
                f"| {c['mode']} | {q2:.1f} [{q1:.1f}-{q3:.1f}] | {c['compute_ops']} | "
                f"{c['compute_ms']:.1f} | {c['rest_ms']:.1f} |"
            )
        print()


if __name__ == "__main__":
    main()
