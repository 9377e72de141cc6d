"""``make bench``: run every ``benchmarks/bench_*.py`` in its own process, one after the other.

Each benchmark prints a Markdown table with the median figures of one run; copy them into
``docs/benchmarks.md`` together with the command.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    here = Path(__file__).parent
    failed = []
    for script in sorted(here.glob("bench_*.py")):
        print(f"\n## {script.stem}\n", flush=True)
        result = subprocess.run([sys.executable, "-m", f"benchmarks.{script.stem}"], check=False)
        if result.returncode != 0:
            failed.append(script.stem)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
