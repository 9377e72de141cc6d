"""All-to-all exchanges for dispatch/combine over ``torch.distributed``, with an injectable delay.

Every exchange is issued from the caller's thread and returns a :class:`Pending` at once; the caller
waits on it as late as it can. Underneath, one *communication thread* per rank (the CPU analogue of a
GPU communication stream / DeepEP's proxy) runs the rank's exchanges in the order they were issued —
the same order on every rank, so gloo pairs them correctly:

* dispatch: the layout exchange (how many rows each rank sends to each of this rank's slots; a
  blocking ``all_to_all_single`` of ``world * slots`` counts), then the payload
  ``all_to_all_single`` with split sizes, issued with ``async_op=True``;
* combine: the payload ``all_to_all_single`` (splits known from the dispatch), ``async_op=True``.

The layout exchange blocks only the communication thread, so the compute thread keeps working while
ranks wait for each other (DeepEP's normal-mode dispatch also learns the receive counts first).

Injected network delay (for benchmarks on one machine, where gloo over loopback is nearly free): every
payload exchange completes ``delay_s`` seconds after gloo reports it complete, i.e. the data is not
handed to the caller before then (``Pending.wait`` sleeps for what is left). Exchanges in flight at
the same time are delayed concurrently, as messages on a network are. Compute that runs between issue
and wait hides that time, exactly as compute hides wire time on a real network. The layout exchange
is not delayed (a few bytes per peer). The communication interval recorded for the timeline is
``[issue, completion + delay)``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from moeinfra.moe.timeline import Recorder


class Pending:
    """An exchange in flight; :meth:`wait` returns ``(output, recv_counts)`` once usable (on one
    rank the output is the tensor that was sent: nothing moves, nothing is copied).

    ``recv_counts`` is the layout a dispatch received (``[world * slots]`` int64), None for a combine.
    """

    def __init__(self, comm: Communicator, name: str) -> None:
        self.name = name
        self._comm = comm
        self._issued = time.perf_counter()
        self._done_at: float | None = None
        self._lock = threading.Lock()
        self._started: Future | None = None
        self._result: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _mark_done(self, _future=None) -> None:
        with self._lock:
            if self._done_at is None:
                self._done_at = time.perf_counter()

    def wait(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block until the exchange (plus the injected delay) is complete."""
        if self._result is not None:
            return self._result
        work, output, counts = self._started.result()
        if work is not None:
            work.wait()
        self._mark_done()
        with self._lock:
            done = self._done_at
        ready = done + self._comm.delay_s
        left = ready - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self._comm.recorder.comm(self.name, self._issued, max(ready, done))
        self._result = (output, counts)
        return self._result


class Communicator:
    """Expert-parallel exchanges of one rank.

    Args:
        group: process group (default: the default group; single-process use needs none).
        delay_s: injected delay per payload exchange, seconds (see the module docstring).
        recorder: where communication intervals go.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        delay_s: float = 0.0,
        recorder: Recorder | None = None,
    ) -> None:
        self.group = group
        self.delay_s = float(delay_s)
        self.recorder = recorder or Recorder(enabled=False)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self._thread: ThreadPoolExecutor | None = None

    def _submit(self, pending: Pending, task) -> Pending:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-comm")
        pending._started = self._thread.submit(task)
        return pending

    def _payload(self, pending: Pending, send, send_splits, recv_splits):
        out = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        work = dist.all_to_all_single(
            out, send, recv_splits, send_splits, group=self.group, async_op=True
        )
        # gloo completes the future on its worker thread: the completion time, not the wait time.
        work.get_future().then(pending._mark_done)
        return work, out

    def dispatch(self, send: torch.Tensor, slot_counts: torch.Tensor, name: str) -> Pending:
        """Issue a dispatch: ``send [N, H]`` rows sorted by destination slot, ``slot_counts
        [world * slots]`` rows per global slot. ``wait()`` gives the received rows (by source rank,
        then slot) and the received counts ``[world * slots]`` (source-major)."""
        pending = Pending(self, name)
        if self.world_size == 1:  # nothing is sent: the caller's rows are the received rows
            pending._started = _done((None, send, slot_counts))
            pending._mark_done()
            return pending

        slots = slot_counts.numel() // self.world_size
        send_splits = slot_counts.view(self.world_size, slots).sum(1).tolist()

        def task():
            start = time.perf_counter()
            counts = torch.empty_like(slot_counts)
            dist.all_to_all_single(counts, slot_counts, group=self.group)
            self.recorder.comm(f"{name}.layout", start, time.perf_counter())
            recv_splits = counts.view(self.world_size, slots).sum(1).tolist()
            work, out = self._payload(pending, send, send_splits, recv_splits)
            return work, out, counts

        return self._submit(pending, task)

    def all_to_all(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], name: str
    ) -> Pending:
        """Issue ``all_to_all_single`` of the rows of ``send [sum(send_splits), H]``."""
        pending = Pending(self, name)
        if self.world_size == 1:
            pending._started = _done((None, send, None))
            pending._mark_done()
            return pending

        def task():
            work, out = self._payload(pending, send, send_splits, recv_splits)
            return work, out, None

        return self._submit(pending, task)

    def close(self) -> None:
        """Stop the communication thread (after every exchange was waited for)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
