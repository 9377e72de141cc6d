"""EPLB's first call in a fresh environment: whole-process time to a DeepSeek-V3-scale plan.

Run: ``.venv/bin/python -m benchmarks.bench_eplb_first_call [--reps 3]``

Each measurement is a new Python process that imports ``moeinfra.eplb`` and plans 58 layers x 256
experts onto 288 slots of 32 GPUs on 4 nodes (``rebalance``, default policy), with numba's cache in a
fresh temporary ``NUMBA_CACHE_DIR``:
- ``compiled, cold cache``: ``MOEINFRA_EPLB_JIT=compiled`` — numba compiles before the first plan
  (what every first call did before the interpreted fallback);
- ``auto, cold cache``: the default — interpreted, with the background compile started;
- ``auto, warm cache``: the default after that background compile finished.
Medians of ``--reps`` processes; "first plan" is the call alone, "process" includes start-up and
imports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CODE = """
import time
t0 = time.perf_counter()
from moeinfra.eplb import jit, rebalance
from moeinfra.eplb.synthetic import synthetic_load
load = synthetic_load("zipf", 58, 256, seed=0)
t1 = time.perf_counter()
rebalance(load, 288, 8, 4, 32)
t2 = time.perf_counter()
rebalance(load, 288, 8, 4, 32)
t3 = time.perf_counter()
import json
print(json.dumps({"import_s": t1 - t0, "first_s": t2 - t1, "second_s": t3 - t2,
                  "compiled": jit.COMPILED, "marker": str(jit.marker_path())}))
"""


def _process(cache: Path, mode: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "MOEINFRA_EPLB_JIT": mode}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CODE], env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(proc.stdout)
    result["process_s"] = time.perf_counter() - start
    return result


def _wait_for(path: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"background warm-up did not write {path}")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    rows: dict[str, list[dict]] = {
        "compiled, cold cache": [],
        "auto, cold cache": [],
        "auto, warm cache": [],
    }
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as d:
            rows["compiled, cold cache"].append(_process(Path(d), "compiled"))
        with tempfile.TemporaryDirectory() as d:
            cold = _process(Path(d), "auto")
            rows["auto, cold cache"].append(cold)
            _wait_for(cold["marker"])  # the background compile, before anything else is timed
            rows["auto, warm cache"].append(_process(Path(d), "auto"))
    print(
        "| case | kernels | process (s) | import (s) | first plan (s) | second plan (ms) |\n"
        "|---|---|---|---|---|---|"
    )
    for case, results in rows.items():
        med = {
            k: statistics.median(r[k] for r in results)
            for k in ("process_s", "import_s", "first_s", "second_s")
        }
        kind = "compiled" if results[0]["compiled"] else "interpreted"
        print(
            f"| {case} | {kind} | {med['process_s']:.2f} | {med['import_s']:.2f} | "
            f"{med['first_s']:.2f} | {med['second_s'] * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
