"""Start ``N`` local gloo processes, run a function on each, collect the results — never hang.

Equivalent ``torchrun`` launch (one process per rank, any backend)::

    torchrun --nproc-per-node N examples/moe_torchrun.py --tokens 256 --redundant 4
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from moeinfra.errors import InputError
from moeinfra.launcher import Ranks, join_group


def _worker(rank: int, world: int, port: int, fn, args, collective_timeout_s: float) -> Any:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    from moeinfra.memory import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()
    join_group(port, rank, world, "gloo", collective_timeout_s)
    # on failure the group stays up until the process ends: a peer that saw it close first would
    # report its broken collective before this rank's error
    result = fn(*args)
    dist.destroy_process_group()
    return result


def launch(
    world_size: int,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned gloo ranks; return each rank's result (rank order).

    ``fn`` must be importable by name (a module-level function). Raises ``RuntimeError``
    (:class:`~moeinfra.launcher.RankFailed`) naming the rank that failed first with its traceback
    or exit code, ``TimeoutError`` after ``timeout_s``; either way every rank is stopped.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size={world_size!r} must be a positive integer")
    per_rank = (fn, tuple(args), max(10.0, timeout_s))
    ranks = Ranks(_worker, [per_rank] * world_size, name=getattr(fn, "__name__", "launch"))
    try:
        return ranks.wait(timeout_s)
    finally:
        ranks.close()
