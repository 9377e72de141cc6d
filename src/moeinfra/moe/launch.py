"""Start ``N`` local gloo processes, run a function on each, collect the results — never hang.

Equivalent ``torchrun`` launch (one process per rank, any backend)::

    torchrun --nproc-per-node N examples/moe_torchrun.py --tokens 256 --redundant 4
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from moeinfra.errors import InputError


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a process of someone else's to bind (it may be
    taken in between: ranks this process spawns meet at :func:`serve_store` instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_store():
    """A ``TCPStore`` this process serves on 127.0.0.1, on a port the kernel picks and this
    process keeps bound: the ranks it spawns meet there (:func:`join_group`). Keep it referenced
    until they have joined. (A port picked free, closed, and bound again by a rank can be taken
    by another process in between.)"""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def join_group(port: int, rank: int, world: int, backend: str, timeout_s: float) -> None:
    """``init_process_group`` of a spawned rank over the parent's :func:`serve_store` at
    ``port``."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _worker(
    rank: int, world: int, port: int, fn, args, results, collective_timeout_s: float
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    from moeinfra.memory import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()
    try:
        join_group(port, rank, world, "gloo", collective_timeout_s)
        try:
            results.put((rank, True, fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report to the parent instead of leaving the other ranks waiting
        results.put((rank, False, traceback.format_exc(limit=6)))


def launch(
    world_size: int,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned gloo ranks; return each rank's result (rank order).

    ``fn`` must be importable by name (a module-level function). Raises ``RuntimeError`` with the
    failing ranks' tracebacks, ``TimeoutError`` after ``timeout_s`` (all processes are killed).
    """
    import torch.multiprocessing as mp

    if not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size={world_size!r} must be a positive integer")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = serve_store()
    port = store.port
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, tuple(args), results, max(10.0, timeout_s)),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(out) + len(errors) < world_size:
            left = deadline - time.monotonic()
            try:
                rank, ok, value = results.get(timeout=max(0.1, min(left, 1.0)))
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{world_size}-rank run timed out after {timeout_s}s "
                        f"({len(out)} ranks finished)"
                    ) from None
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                missing = [r for r in dead if r not in out and r not in errors]
                if missing:
                    raise RuntimeError(f"ranks {missing} died without a result") from None
                if errors:  # a failed rank leaves the others blocked in a collective
                    break
                continue
            (out if ok else errors)[rank] = value
        if errors:
            detail = "\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items()))
            raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n{detail}")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [out[r] for r in range(world_size)]
