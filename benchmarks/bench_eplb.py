"""EPLB benchmark at DeepSeek-V3 scale: ``python -m benchmarks.bench_eplb [--repeats N]``.

Prints the Markdown table recorded in docs/benchmarks.md (medians of N timed calls, one run).
"""

from __future__ import annotations

import argparse
import platform

import numba
import numpy as np

from moeinfra.eplb.bench import markdown_table, run_benchmark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = run_benchmark(repeats=args.repeats)
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, numba {numba.__version__}, "
        f"{args.repeats} timed calls per cell\n"
    )
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
