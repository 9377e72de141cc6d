"""Expert-parallel MoE step time with and without dual micro-batch overlap, injected network delay.

Run: ``.venv/bin/python -m benchmarks.bench_moe [--reps 7] [--delay-ms 4] [--worlds 2 4]``

Each world size is one set of spawned gloo ranks: the tiny preset with 4 decoder layers and a wider
expert (moe_intermediate_size 512, so that expert compute outweighs attention as in DeepSeek-V3's
prefill), 2048 tokens per rank in sequences of 128. Every exchange (dispatch or combine payload)
completes ``delay`` after gloo delivers it (``moeinfra.moe.comm``): the compute thread cannot use the
data before then, so only compute issued in between can hide it. Modes and delays are interleaved inside each repetition; a step's time is the
slowest rank's; medians over the repetitions.

Two measures of hiding:
- ``injected hidden``: 1 - (T(mode, delay) - T(mode, 0)) / (exchanges x delay) — the share of the
  injected communication time that does not show up in the step time;
- ``comm hidden (timeline)``: |comm ∩ compute| / |comm| on the recorded intervals (all communication,
  the layout exchange and gloo's own time included), mean over ranks.
"""

from __future__ import annotations

import argparse
import statistics

from moeinfra.moe.launch import launch
from moeinfra.moe.run import RunConfig, measure_rank
from moeinfra.moe.schedules import schedule

MODES = ("none", "prefill", "decode")


def bench_world(
    world: int, delay_s: float, reps: int, tokens: int, layers: int, seq_len: int, intermediate: int
) -> list[dict]:
    run = RunConfig(
        world_size=world,
        tokens=tokens,
        seq_len=seq_len,
        layers=layers,
        redundant=world,
        overrides=(("moe_intermediate_size", intermediate),),
    )
    delays = (0.0, delay_s)
    ranks = launch(world, measure_rank, (run, MODES, delays, reps), timeout_s=900)
    rows = []
    for mode in MODES:
        exchanges = sum(op.kind in ("DISPATCH", "COMBINE") for op in schedule(mode, layers))
        base = statistics.median(ranks[0][f"{mode}/0.0"]["times_s"])
        delayed = statistics.median(ranks[0][f"{mode}/{delay_s}"]["times_s"])
        fractions = [
            r[f"{mode}/{delay_s}"]["overlap_s"] / r[f"{mode}/{delay_s}"]["comm_s"] for r in ranks
        ]
        rows.append(
            {
                "world": world,
                "mode": mode,
                "t0_ms": base * 1e3,
                "t_ms": delayed * 1e3,
                "injected_ms": exchanges * delay_s * 1e3,
                "injected_hidden": 1 - (delayed - base) / (exchanges * delay_s),
                "timeline_hidden": statistics.fmean(fractions),
            }
        )
    none_t = rows[0]["t_ms"]
    for row in rows:
        row["speedup"] = none_t / row["t_ms"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--delay-ms", type=float, default=4.0)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=512, help="expert intermediate size")
    args = parser.parse_args(argv)
    print(
        f"tiny preset, {args.layers} layers, expert intermediate {args.intermediate}, "
        f"{args.tokens} tokens/rank in sequences of {args.seq_len}, injected delay "
        f"{args.delay_ms} ms per exchange, medians of {args.reps} repetitions\n"
    )
    print(
        "| ranks | overlap | step, no delay (ms) | step, with delay (ms) | injected (ms) | "
        "injected hidden | comm hidden (timeline) | speed-up vs none (with delay) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in args.worlds:
        for r in bench_world(
            world,
            args.delay_ms / 1e3,
            args.reps,
            args.tokens,
            args.layers,
            args.seq_len,
            args.intermediate,
        ):
            print(
                f"| {r['world']} | {r['mode']} | {r['t0_ms']:.1f} | {r['t_ms']:.1f} | "
                f"{r['injected_ms']:.0f} | {r['injected_hidden']:.0%} | {r['timeline_hidden']:.0%} | "
                f"{r['speedup']:.2f}x |"
            )


if __name__ == "__main__":
    main()
