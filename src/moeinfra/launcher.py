"""Start ``R`` local ranks, watch them, stop them all: the one place moeinfra spawns ranks.

The ranks are processes of torch elastic's process layer
(:func:`torch.distributed.elastic.multiprocessing.start_processes`, with which the elastic agent and
``torchrun`` start and watch their workers), started with ``spawn``; their stdout and stderr stay
this process's. They meet at a ``TCPStore`` this process serves on a port the kernel picks and this
process keeps bound (:func:`join_group`): a port picked free, closed and bound again by a rank can
be taken by another process in between. A rank that raises or dies stops every rank (its peers
would block in their next collective) and :class:`RankFailed` names it with its traceback or exit
code; every wait has a deadline; a rank whose parent dies gets ``SIGINT`` (torch sets
``PR_SET_PDEATHSIG``).

:func:`moeinfra.moe.launch.launch` (a function on ``R`` gloo ranks, their results collected) and
``LLM(ranks=R)`` (a unit of engine ranks fed by queues) start their ranks here. ``moeinfra serve
unit`` runs its ranks under the elastic agent itself, on this same layer: a c10d rendezvous across
hosts and restarts, which cost a rendezvous per start that these local launches do not need.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing.util  # noqa: F401  (its exit hook joins live children: ours must run first)
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

#: a waiting parent looks at its ranks after this long, doubling up to the second value (a look
#: costs ~0.15 ms of CPU: every 5 ms it took 0.15 s from the ranks of a 5 s launch on 2 cores)
POLL_S = (0.002, 0.05)


class RankFailed(RuntimeError):
    """A rank raised or died; every rank of its group has been stopped."""


def join_group(port: int, rank: int, world: int, backend: str, timeout_s: float) -> None:
    """``init_process_group`` of a rank of a :class:`Ranks` over its parent's store at
    ``port``."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


class Ranks:
    """``len(args)`` spawned ranks; rank ``r`` runs ``fn(r, world, store_port, *args[r])``.

    ``fn`` must be importable by name (a module-level function) and ``args`` picklable
    (queues of a ``spawn`` context are). Rank ``r`` joins the group with :func:`join_group`.
    :meth:`poll` and :meth:`wait` return the ranks' return values; :meth:`close` stops them.
    """

    def __init__(
        self, fn: Callable[..., Any], args: Sequence[tuple], *, name: str | None = None
    ) -> None:
        from torch.distributed import TCPStore
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

        self.world = len(args)
        self.name = name or fn.__name__
        self._results: list[Any] | None = None
        self._failed: RankFailed | None = None
        self._logs = tempfile.TemporaryDirectory(prefix="moeinfra-ranks-")  # the error files
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with _signal_handlers_kept():
            self._procs = start_processes(
                name=self.name,
                entrypoint=fn,
                args={r: (r, self.world, self.store.port, *a) for r, a in enumerate(args)},
                envs={r: {} for r in range(self.world)},
                logs_specs=DefaultLogsSpecs(log_dir=self._logs.name),
                start_method="spawn",
            )
        _live.add(self)

    def poll(self) -> list[Any] | None:
        """Every rank's return value (rank order) once all have returned; None while any runs.
        Raises :class:`RankFailed` once one has raised or died (all of them are stopped then):
        a rank that raised counts at once, even if its process cannot end (a thread of its own
        stuck in a collective)."""
        if self._failed is not None:
            raise self._failed
        if self._results is None:
            done = self._procs.wait(0)
            if done is None or done.is_failed():
                told = self._recorded()
                if done is None and not told:
                    return None
                self._failed = self._failure(done, told)
                raise self._failed
            self._results = [done.return_values[r] for r in range(self.world)]
            self.close()
        return self._results

    def wait(self, timeout_s: float) -> list[Any]:
        """:meth:`poll` until the ranks return; ``TimeoutError`` (all stopped) after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        pause = POLL_S[0]
        while (results := self.poll()) is None:
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(
                    f"{self.name}: {self.world} ranks did not finish in {timeout_s:g} s"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
        return results

    def close(self) -> None:
        """Stop every rank still running (``SIGTERM``, ``SIGKILL`` 5 s later); idempotent."""
        self._procs.close(timeout=5)
        self._logs.cleanup()
        _live.discard(self)

    def _recorded(self) -> dict[int, tuple[int, str]]:
        """``{rank: (when, traceback)}`` of the ranks that raised (torch elastic's ``record``
        wrote their error files)."""
        told = {}
        for rank, path in self._procs.error_files.items():
            # none (yet), or half written
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError), open(path) as f:
                told[rank] = (os.stat(path).st_mtime_ns, _traceback(json.load(f)))
        return told

    def _failure(self, done, told: dict[int, tuple[int, str]]) -> RankFailed:
        """Stop every rank; the error of the rank that failed first, naming those after it."""
        self.close()
        died = next(iter(done.failures.values())) if done is not None else None
        if died is not None and died.local_rank not in told:
            # the first to end did not raise (a signal, os._exit): what its peers raised came after
            first = died.local_rank
            how = f"was killed by {died.signal_name()}" if died.exitcode < 0 else "exited"
            story = f"it {how} without raising an exception"
        else:  # the rank that raised first (it may have ended after a peer it broke)
            first = min(told, key=lambda r: told[r][0])
            story = told[first][1]
        code = (
            f", exit code {died.exitcode}" if died is not None and died.local_rank == first else ""
        )
        after = [
            f"rank {r}: {told[r][1].strip().splitlines()[-1]}" for r in sorted(told) if r != first
        ]
        also = f"\n(failed after it: {'; '.join(after)})" if after else ""
        return RankFailed(
            f"{self.name}: rank {first} of {self.world} failed{code}:\n{story.rstrip()}{also}"
        )


def _traceback(error_file: dict) -> str:
    """The traceback a rank's error file (torch elastic's ``record``) holds."""
    message = error_file["message"]
    if isinstance(message, str):
        return message
    return message["extraInfo"].get("py_callstack") or message["message"]


@contextlib.contextmanager
def _signal_handlers_kept():
    """``start_processes`` makes ``SIGTERM``, ``SIGINT``, ``SIGHUP`` and ``SIGQUIT`` raise its
    ``SignalException`` in this process (the agent's way to stop); the caller keeps its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    kept = {sig: signal.getsignal(sig) for n in names if (sig := getattr(signal, n, None))}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


# the ranks are not daemons (they may start processes of their own): at exit, stop the ranks of
# groups still open before multiprocessing's exit hook waits for them
_live: set[Ranks] = set()
atexit.register(lambda: [ranks.close() for ranks in list(_live)])
