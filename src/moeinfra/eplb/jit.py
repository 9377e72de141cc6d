"""EPLB's loops compiled by numba once its on-disk cache holds them, the same Python code until then.

Compiling every kernel takes 7-13 s; the same loops interpreted plan DeepSeek-V3's 58 layers x 288
slots in ~0.2 s (the kernels' own code, so plans are identical either way). So the first call in a
fresh environment does not wait for the compiler:

* ``auto`` (default): when this environment's kernels were compiled into numba's cache before
  (a marker beside that cache — ``NUMBA_CACHE_DIR``, else this package's ``__pycache__`` when
  writable, else ``~/.cache/numba`` — keyed by the kernel sources, numba and Python), the kernels
  are numba-compiled and load from that cache. Otherwise
  they run interpreted in this process, and one background process (``python -m
  moeinfra.eplb.jit``) compiles them into the cache, so every process started after it runs compiled.
* ``compiled``: always numba (compiles on the first call when the cache is cold).
* ``interpreted``: never numba (numba is not even imported).

The mode is read once, from ``MOEINFRA_EPLB_JIT``, when the first kernel module is imported.
``moeinfra eplb warm`` compiles into the cache in the foreground.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from moeinfra.errors import InputError

MODE_ENV = "MOEINFRA_EPLB_JIT"
MODES = ("auto", "compiled", "interpreted")
KERNEL_MODULES = ("packing", "local_search", "plan", "deepseek")
_STALE_LOCK_S = 600.0  # a warm-up older than this is taken to have died


def _marker_dir() -> Path:
    """Where numba caches this package's kernels, so the marker is found (and lost) with them."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    here = Path(__file__).parent
    if os.access(here, os.W_OK):
        return here / "__pycache__"
    return Path.home() / ".cache" / "numba"


def _key() -> str:
    here = Path(__file__).parent
    parts = [
        importlib.metadata.version("numba"),
        sys.version,
        platform.machine(),
    ]
    for name in KERNEL_MODULES:
        stat = (here / f"{name}.py").stat()
        parts.append(f"{name}:{stat.st_mtime_ns}:{stat.st_size}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


def marker_path() -> Path:
    """The file whose presence says this environment's kernels are in numba's cache."""
    return _marker_dir() / f"eplb-jit-{_key()}.ok"


def _mode() -> str:
    mode = os.environ.get(MODE_ENV, "auto")
    if mode not in MODES:
        raise InputError(f"{MODE_ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def _start_warmup(marker: Path) -> None:
    """Compile in one background process (a lock file keeps concurrent cold starts to one)."""
    lock = marker.with_suffix(".lock")
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        if lock.exists() and time.time() - lock.stat().st_mtime < _STALE_LOCK_S:
            return
        lock.unlink(missing_ok=True)
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:  # read-only cache folder, or another process won the race
        return
    env = dict(os.environ, **{MODE_ENV: "compiled"})
    subprocess.Popen(
        [sys.executable, "-m", "moeinfra.eplb.jit", str(marker)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _decide() -> bool:
    mode = _mode()
    if mode != "auto":
        return mode == "compiled"
    marker = marker_path()
    if marker.exists():
        return True
    _start_warmup(marker)
    return False


COMPILED = _decide()
"""Whether this process runs the kernels numba-compiled (decided once, at import)."""


def kernel(**options) -> Callable[[Callable], Callable]:
    """``numba.njit(cache=True, **options)`` when :data:`COMPILED`, else the function as written."""

    def wrap(func: Callable) -> Callable:
        if not COMPILED:
            return func
        import numba

        return numba.njit(cache=True, **options)(func)

    return wrap


def warm(marker: Path | None = None) -> Path:
    """Compile every kernel into numba's cache (plans of each kind on small inputs), then write the
    marker atomically. Needs :data:`COMPILED` (``MOEINFRA_EPLB_JIT=compiled``). Returns the marker."""
    if not COMPILED:
        raise InputError(f"warming the cache needs {MODE_ENV}=compiled in this process")
    import numpy as np

    from moeinfra.eplb import evaluate, rebalance, rebalance_experts

    rng = np.random.default_rng(0)
    load = rng.lognormal(size=(4, 16)) * 100
    drifted = load * rng.uniform(0.8, 1.2, size=load.shape)
    for policy, nodes in (("hierarchical", 2), ("global", 1), ("deepseek", 2)):
        plan = rebalance(load, 24, 4, nodes, 8, policy=policy)
        evaluate(plan, load)
        if policy != "deepseek":
            evaluate(rebalance(drifted, 24, 4, nodes, 8, policy=policy, previous=plan), drifted)
    rebalance_experts(load, 24, 4, 2, 8)
    rebalance_experts(load, 24, 3, 2, 8)  # the global fallback (groups not a multiple of nodes)
    marker = marker or marker_path()
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("numba cache warm\n")
    tmp.replace(marker)
    return marker


if __name__ == "__main__":  # the background warm-up started by _start_warmup
    from moeinfra.eplb import jit  # the module the kernels were built with, not this __main__ copy

    target = Path(sys.argv[1])
    try:
        jit.warm(target)
    finally:
        target.with_suffix(".lock").unlink(missing_ok=True)
