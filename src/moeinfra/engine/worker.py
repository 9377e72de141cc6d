"""The loop every rank of a unit runs, in lockstep: take new work, agree on the step, step.

Each iteration the ranks all-reduce four flags — any work, any prompt tokens (which picks the
micro-batch schedule every rank must share), shutdown requested, rebalance requested — so they run
the same steps with the same schedule, and a rank with nothing to do still joins every collective.
:func:`run_steps` is the loop for a process that is its own driver (one rank, or every rank of a
``torchrun`` job); :func:`worker_main` is a spawned rank fed by queues from :class:`~moeinfra.engine.
llm.LLM`.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from moeinfra.engine.core import EngineConfig, EngineCore
from moeinfra.engine.device import collective_backend, place_rank
from moeinfra.engine.outputs import StepOutput
from moeinfra.errors import InputError


def agree(core: EngineCore, shutdown: bool = False, rebalance: bool = False) -> list[bool]:
    """``[any work, any prompt tokens, shutdown, rebalance]`` over the unit's ranks."""
    flags = [core.has_work, core.has_work and core.has_prefill(), shutdown, rebalance]
    if not (core.comm.distributed and core.comm.world_size > 1):
        return flags
    # on the unit's device: NCCL reduces device tensors only
    agreed = torch.tensor(flags, dtype=torch.int64, device=core.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=core.comm.group)
    return [bool(f) for f in agreed.tolist()]


def run_steps(core: EngineCore) -> Iterator[list[StepOutput]]:
    """Step until no rank has work (collective); yields each step's outputs of this rank."""
    while True:
        work, prefill, _, _ = agree(core)
        if not work:
            return
        yield core.step(core.overlap_mode(prefill))


def worker_main(
    rank: int,
    world: int,
    store_port: int,
    model_dir: str,
    config: EngineConfig,
    comm_delay_s: float,
    inbox,
    outbox,
    collective_timeout_s: float,
) -> None:
    """A rank of a :class:`~moeinfra.launcher.Ranks` group: messages in ``inbox`` are ``("add",
    request_id, prompt_ids, params)``, ``("abort", request_id)``, ``("rebalance",)``,
    ``("shutdown",)``; it puts ``("ready", rank)`` and ``("out", rank, [StepOutput])`` in
    ``outbox``. An error ends the process (the launcher reports it and stops the other ranks)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from moeinfra.launcher import join_group
    from moeinfra.moe.comm import Communicator

    device = place_rank(config.device, rank)
    join_group(store_port, rank, world, collective_backend(device), collective_timeout_s)
    comm = Communicator(delay_s=comm_delay_s)
    core = EngineCore(model_dir, config, comm)
    outbox.put(("ready", rank))
    _serve(core, inbox, outbox)
    # only after a clean stop: the group of a failed rank stays up until its process ends, so
    # its error is recorded before a peer's broken collective
    comm.close()
    dist.destroy_process_group()


IDLE_WAIT_S = (0.001, 0.01)  # an idle rank waits for messages this long, doubling while idle


def serve_loop(
    core: EngineCore,
    receive: Callable[[float | None], list[tuple]],
    emit: Callable[[list[StepOutput]], None],
    handle: Callable[[tuple], None] | None = None,
) -> None:
    """Run a rank until a shutdown agreed by every rank of the unit.

    ``receive(timeout)`` returns the messages waiting (blocking up to ``timeout`` seconds when the
    rank is idle, not at all when ``timeout`` is None): ``("add", request_id, prompt_ids, params,
    **options)``-style tuples of kinds ``add``, ``abort``, ``rebalance``, ``shutdown``; any other
    kind goes to ``handle``. ``emit(outputs)`` runs every iteration with the step's outputs (empty when
    idle), so a caller can also ship what else the step produced (:attr:`EngineCore.handoffs`) and
    report its state while idle.
    """
    shutdown = rebalance = False
    wait = IDLE_WAIT_S[0]
    unit_busy = False  # some rank had work at the last agreement
    while True:
        # wait for messages only when the whole unit is idle: a rank without work of its own that
        # waited here would hold its busy peers in the next collective for the whole wait
        idle = not (core.has_work or unit_busy)
        wait = min(2 * wait, IDLE_WAIT_S[1]) if idle else IDLE_WAIT_S[0]
        for message in receive(wait if idle else None):
            wait = IDLE_WAIT_S[0]
            kind = message[0]
            if kind == "add":
                try:
                    core.add_request(*message[1:4], **(message[4] if len(message) > 4 else {}))
                except InputError as err:  # a request this rank cannot take fails alone
                    if handle is None:
                        raise
                    handle(("failed", message[1], str(err)))
            elif kind == "abort":
                out = core.abort(message[1])
                if out is not None:
                    emit([out])
            elif kind == "rebalance":
                rebalance = True
            elif kind == "shutdown":
                shutdown = True
            elif handle is not None:
                handle(message)
        work, prefill, stop, balance = agree(core, shutdown, rebalance)
        unit_busy = work
        if stop:
            return
        if balance:
            core.rebalance()
            rebalance = False
        emit(core.step(core.overlap_mode(prefill)) if work else [])


def _serve(core: EngineCore, inbox, outbox) -> None:
    def receive(timeout: float | None) -> list[tuple]:
        messages = []
        try:
            messages.append(inbox.get(timeout=timeout) if timeout else inbox.get_nowait())
            while True:
                messages.append(inbox.get_nowait())
        except queue.Empty:
            return messages

    def emit(outputs: list[StepOutput]) -> None:
        if outputs:
            outbox.put(("out", core.comm.rank, outputs))

    serve_loop(core, receive, emit)
