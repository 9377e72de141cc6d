"""Peak memory and wall time of ``moeinfra trace report`` on a ~300 MB trace (.json and .json.gz).

The trace repeats DeepSeek's training trace end to end (times shifted by one span per copy,
correlation / External ids and flow ids shifted so they stay unique), written once into
``--data-dir`` (default ``/tmp/moeinfra_bench_trace``, never the repository) and reused by later runs.
Each measurement is a fresh process running the console command; its peak resident set comes from
``os.wait4`` (the child's own ``ru_maxrss``), its wall time from ``time.perf_counter``.

Run: ``.venv/bin/python -m benchmarks.bench_trace_memory [--reps 3] [--size-mb 300] [--src DIR]``.
``--src`` puts another checkout's ``src`` first on ``PYTHONPATH`` (e.g. the reader before a change).
Prints a Markdown table of medians.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEEPSEEK_TRACE = (
    Path(__file__).resolve().parents[1] / "examples" / "data" / "deepseek_train_trace.json"
)
DEFAULT_DATA_DIR = Path("/tmp/moeinfra_bench_trace")


def _shift(event: dict, k: int, dt: int, id_stride: int) -> dict:
    """Copy ``k`` of ``event``: ts + k * dt µs, ids + k * id_stride."""
    e = dict(event)
    if isinstance(e.get("ts"), int):
        e["ts"] += k * dt
    if e.get("ph") in ("s", "f") and isinstance(e.get("id"), int):
        e["id"] += k * id_stride
    args = e.get("args")
    if isinstance(args, dict):
        args = e["args"] = dict(args)
        for key in ("correlation", "External id"):
            if isinstance(args.get(key), int):
                args[key] += k * id_stride
    return e


def build_trace(path: Path, target_mb: float, source: Path = DEEPSEEK_TRACE) -> Path:
    """Write a Kineto-like trace of about ``target_mb`` MB to ``path`` by repeating ``source``'s events.

    Metadata events (``ph`` ``M``) are written once; head fields (``schemaVersion``,
    ``deviceProperties``, ``distributedInfo``) before ``traceEvents``, ``traceName`` and
    ``displayTimeUnit`` after it, as Kineto does.
    """
    doc = json.loads(source.read_bytes())
    events = doc["traceEvents"]
    timed = [e for e in events if isinstance(e.get("ts"), int)]
    t0 = min(e["ts"] for e in timed)
    t1 = max(e["ts"] + (e.get("dur") or 0) for e in timed)
    dt = t1 - t0 + 1000  # one span plus 1 ms between copies
    ids = [
        v
        for e in events
        for v in (
            e.get("id"),
            *(e.get("args", {}).get(k) for k in ("correlation", "External id")),
        )
        if isinstance(v, int)
    ]
    id_stride = max(ids) + 1
    meta = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M"]
    per_copy = sum(len(json.dumps(e)) + 4 for e in body)
    copies = max(1, round(target_mb * 1e6 / per_copy))
    tmp = path.with_suffix(".part")
    with tmp.open("w") as out:
        out.write("{\n")
        for key in ("schemaVersion", "deviceProperties", "distributedInfo"):
            if key in doc:
                out.write(f'  "{key}": {json.dumps(doc[key])},\n')
        out.write('  "traceEvents": [\n')
        sep = ""
        for e in meta:
            out.write(f"{sep}  {json.dumps(e)}")
            sep = ",\n"
        for k in range(copies):
            for e in body:
                out.write(f"{sep}  {json.dumps(_shift(e, k, dt, id_stride))}")
                sep = ",\n"
        out.write("\n  ],\n")
        out.write(f'  "traceName": {json.dumps(doc.get("traceName", "repeated"))},\n')
        out.write('  "displayTimeUnit": "ms"\n}\n')
    tmp.replace(path)
    return path


def gzip_copy(path: Path) -> Path:
    """``path`` compressed to ``path.gz`` (level 6)."""
    gz = path.with_name(path.name + ".gz")
    tmp = gz.with_suffix(".part")
    with path.open("rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    tmp.replace(gz)
    return gz


def run_once(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """Wall time (s), CPU time (user + system, s) and peak resident set (bytes) of one fresh
    process running ``cmd``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (ru_maxrss in KiB)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--size-mb", type=float, default=300.0)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--src", type=Path, default=None, help="src folder to import moeinfra from")
    parser.add_argument("--only", choices=("json", "gz"), default=None)
    args = parser.parse_args(argv)

    args.data_dir.mkdir(parents=True, exist_ok=True)
    plain = args.data_dir / f"deepseek_x_{args.size_mb:g}mb.json"
    if not plain.exists():
        print(f"building {plain} ...", file=sys.stderr)
        build_trace(plain, args.size_mb)
    gz = plain.with_name(plain.name + ".gz")
    if not gz.exists() or gz.stat().st_mtime < plain.stat().st_mtime:
        print(f"compressing {gz} ...", file=sys.stderr)
        gzip_copy(plain)
    env = dict(os.environ)
    if args.src is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(args.src.resolve()), *filter(None, [env.get("PYTHONPATH")])]
        )
    size = plain.stat().st_size
    rows = []
    for label, path in (("json", plain), ("gz", gz)):
        if args.only not in (None, label):
            continue
        cmd = [sys.executable, "-m", "moeinfra.cli", "trace", "report", str(path)]
        runs = [run_once(cmd, env) for _ in range(args.reps)]
        wall, cpu, rss = (statistics.median(column) for column in zip(*runs, strict=True))
        rows.append((path, path.stat().st_size, wall, cpu, rss, [w for w, _, _ in runs]))

    print(
        f"`moeinfra trace report FILE` in a fresh process, median of {args.reps}; "
        f"load average {os.getloadavg()[0]:.1f} at the end\n"
    )
    print(
        "| file | size | peak RSS | peak RSS / uncompressed size | wall time | CPU time | wall, each run |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for path, fsize, wall, cpu, rss, walls in rows:
        shown = f"{fsize / 1e6:.0f} MB" + (
            f" ({size / 1e6:.0f} MB unpacked)" if fsize != size else ""
        )
        print(
            f"| {path.name} | {shown} | {rss / 1e6:.0f} MB | {rss / size:.2f}x | {wall:.2f} s | "
            f"{cpu:.2f} s | "
            f"{', '.join(f'{w:.2f}' for w in walls)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
