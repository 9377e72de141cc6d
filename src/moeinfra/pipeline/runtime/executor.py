"""Run any :class:`~moeinfra.pipeline.schedule.Schedule` over ``torch.distributed`` point-to-point.

One executor per rank walks that rank's action list. Communication follows from the stage layout:
a forward's outputs go to the next stage of the micro-batch's path, a backward's input gradients to
the previous one; stages on the same rank hand over locally. Sends are ``isend`` and never waited on
before the next compute (their handles are polled and released as they complete); receives are
``irecv`` into buffers allocated from per-stage tensor specs, posted a few actions ahead.

Zero-bubble split (``I`` then ``W``) works with ordinary layers, see
:mod:`moeinfra.pipeline.runtime.weight_grad`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moeinfra.errors import InputError
from moeinfra.pipeline.actions import Action
from moeinfra.pipeline.runtime.weight_grad import backward_input, backward_weight
from moeinfra.pipeline.schedule import Schedule

TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""Shape and dtype of one tensor sent between stages, for one micro-batch."""

_MAX_TENSORS = 64  # tensors per stage boundary; part of the p2p tag


def run_backward(
    tensors: Sequence[torch.Tensor], grad_tensors: Sequence[torch.Tensor | None]
) -> None:
    """Backward from ``tensors`` with ``grad_tensors`` (the building block of an
    ``overlapped_forward_backward`` hook, as DeepSeek's ``run_backward``)."""
    pairs = [(t, g) for t, g in zip(tensors, grad_tensors, strict=True) if t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def as_tuple(value: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


@dataclass
class _Recv:
    works: list
    buffers: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.buffers


class ScheduleExecutor:
    """Executes one rank's part of ``schedule``.

    Args:
        schedule: the schedule (every rank must use the same one).
        rank: this process's pipeline rank in ``schedule``.
        modules: ``{stage id: module}`` for every stage of this rank.
        input_specs: ``model_stage -> [(shape, dtype), ...]``: what model stage ``k`` receives in
            forward for one micro-batch (and so what stage ``k-1`` sends). Gradients have the same specs.
        group: process group (default: the default group).
        group_ranks: ``[num_ranks]`` group rank of each pipeline rank (default: identity).
        lookahead: receives are posted for this many actions ahead of the current one.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        modules: Mapping[int, nn.Module],
        input_specs: Callable[[int], Sequence[TensorSpec]],
        *,
        group: dist.ProcessGroup | None = None,
        group_ranks: Sequence[int] | None = None,
        lookahead: int = 2,
    ) -> None:
        if set(modules) != set(schedule.stages_on(rank)):
            raise InputError(
                f"modules for stages {sorted(modules)}; rank {rank} runs stages {list(schedule.stages_on(rank))}"
            )
        self.schedule = schedule
        self.rank = rank
        self.modules = dict(modules)
        self.input_specs = input_specs
        self.group = group
        self.group_ranks = (
            list(group_ranks) if group_ranks is not None else list(range(schedule.num_ranks))
        )
        self.lookahead = lookahead

    # --- communication -------------------------------------------------------------------------
    def _tag(self, stage: int, mb: int, grad: bool, index: int) -> int:
        return ((mb * self.schedule.num_stages + stage) * 2 + int(grad)) * _MAX_TENSORS + index

    def _peer(self, stage: int) -> int:
        return self.group_ranks[self.schedule.stage_ranks[stage]]

    def _irecv(
        self, src_stage: int, tag_stage: int, mb: int, grad: bool, specs: Sequence[TensorSpec]
    ) -> _Recv:
        works, bufs = [], []
        for i, (shape, dtype) in enumerate(specs):
            buf = torch.empty(shape, dtype=dtype, device=self._device)
            works.append(
                dist.irecv(
                    buf,
                    group=self.group,
                    group_src=self._peer(src_stage),
                    tag=self._tag(tag_stage, mb, grad, i),
                )
            )
            bufs.append(buf)
        return _Recv(works, bufs)

    def _isend(
        self, dst_stage: int, tag_stage: int, mb: int, grad: bool, tensors: Sequence[torch.Tensor]
    ) -> None:
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()
            work = dist.isend(
                t,
                group=self.group,
                group_dst=self._peer(dst_stage),
                tag=self._tag(tag_stage, mb, grad, i),
            )
            self._sends.append((work, t))

    def _release_sends(self) -> None:
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def _specs(self, stage: int) -> Sequence[TensorSpec]:
        specs = list(self.input_specs(self.schedule.model_stage(stage)))
        if not specs or len(specs) > _MAX_TENSORS:
            raise InputError(
                f"input_specs of model stage {self.schedule.model_stage(stage)}: need 1..{_MAX_TENSORS} (shape, dtype) pairs, got {len(specs)}"
            )
        return specs

    def _post_receives(self, action: Action) -> None:
        S = self.schedule
        for part in action.parts():
            s, m = part.stage, part.mb
            if part.kind == "F":
                prev = S.prev_stage(s)
                key = ("F", s, m)
                if prev is not None and S.stage_ranks[prev] != self.rank and key not in self._recvs:
                    self._recvs[key] = self._irecv(prev, s, m, False, self._specs(s))
            elif part.kind in ("B", "I") and not self._forward_only:
                nxt = S.next_stage(s)
                key = ("B", s, m)
                if nxt is not None and S.stage_ranks[nxt] != self.rank and key not in self._recvs:
                    self._recvs[key] = self._irecv(nxt, nxt, m, True, self._specs(nxt))

    # --- compute -------------------------------------------------------------------------------
    def _stage_inputs(self, stage: int, mb: int) -> tuple[torch.Tensor, ...]:
        key = ("F", stage, mb)
        if self.schedule.is_first(stage):
            if mb not in self._user_inputs:
                raise InputError(
                    f"rank {self.rank}: no input for micro-batch {mb} of first stage {stage}"
                )
            return self._user_inputs.pop(mb)
        if key in self._recvs:
            bufs = self._recvs.pop(key).wait()
            if not self._forward_only:
                for b in bufs:
                    if b.is_floating_point():
                        b.requires_grad_()
            return tuple(bufs)
        return self._local.pop(key)

    def _pre_forward(self, stage: int, mb: int) -> tuple[nn.Module, tuple, Callable | None, tuple]:
        x = self._stage_inputs(stage, mb)
        self._inputs[(stage, mb)] = x
        last = self.schedule.is_last(stage)
        criterion = self._criterion if last else None
        labels = self._labels.get(mb, ()) if last else ()
        if last and criterion is not None and mb not in self._labels:
            raise InputError(
                f"rank {self.rank}: no labels for micro-batch {mb} of last stage {stage}"
            )
        return self.modules[stage], x, criterion, labels

    def _post_forward(self, stage: int, mb: int, outputs: tuple, loss: torch.Tensor | None) -> None:
        S = self.schedule
        if self._forward_only:
            self._inputs.pop((stage, mb), None)
        if S.is_last(stage):
            if loss is not None:
                self.losses[mb] = loss.detach()
                if not self._forward_only:
                    self._roots[(stage, mb)] = ([loss], [None])
            elif not self._forward_only:
                raise InputError("criterion is required for a training step (grad enabled)")
            if self._return_outputs:
                self.outputs[mb] = tuple(o.detach() for o in outputs)
            return
        nxt = S.next_stage(stage)
        if not self._forward_only:
            self._roots[(stage, mb)] = (list(outputs), None)
        if S.stage_ranks[nxt] == self.rank:
            self._local[("F", nxt, mb)] = tuple(
                o.detach().requires_grad_(not self._forward_only and o.is_floating_point())
                for o in outputs
            )
        else:
            self._isend(nxt, nxt, mb, False, outputs)

    def _forward(self, stage: int, mb: int) -> None:
        module, x, criterion, labels = self._pre_forward(stage, mb)
        outputs = as_tuple(module(*x))
        loss = criterion(*outputs, *labels) if criterion is not None else None
        self._post_forward(stage, mb, outputs, loss)

    def _pre_backward(self, stage: int, mb: int) -> tuple[list, list]:
        roots, grads = self._roots.pop((stage, mb))
        if grads is None:
            key = ("B", stage, mb)
            if key in self._recvs:
                grads = self._recvs.pop(key).wait()
            else:
                grads = list(self._local.pop(key))
        pairs = [(t, g) for t, g in zip(roots, grads, strict=True) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _post_backward(
        self, stage: int, mb: int, input_grads: Sequence[torch.Tensor | None] | None = None
    ) -> None:
        x = self._inputs.pop((stage, mb))
        if self.schedule.is_first(stage):
            return
        if input_grads is None:
            input_grads = [t.grad for t in x]
        grads = tuple(
            torch.zeros_like(t) if g is None else g for t, g in zip(x, input_grads, strict=True)
        )
        prev = self.schedule.prev_stage(stage)
        if self.schedule.stage_ranks[prev] == self.rank:
            self._local[("B", prev, mb)] = grads
        else:
            self._isend(prev, stage, mb, True, grads)

    def _backward(self, stage: int, mb: int, split: bool) -> None:
        roots, grads = self._pre_backward(stage, mb)
        if not split:
            if roots:
                torch.autograd.backward(roots, grads)
            self._post_backward(stage, mb)
            return
        x = self._inputs[(stage, mb)]
        input_grads, deferred = backward_input(
            roots, grads, x, list(self.modules[stage].parameters())
        )
        self._deferred[(stage, mb)] = deferred
        self._post_backward(stage, mb, input_grads)

    def _weight(self, stage: int, mb: int) -> None:
        backward_weight(self._deferred.pop((stage, mb)))

    def _forward_backward(self, action: Action) -> None:
        f_stage, f_mb, b_stage, b_mb = action.stage, action.mb, action.b_stage, action.b_mb
        m0, m1 = self.modules[f_stage], self.modules[b_stage]
        hook = getattr(type(m0), "overlapped_forward_backward", None)
        if hook is None or type(m0) is not type(m1):
            self._forward(f_stage, f_mb)
            self._backward(b_stage, b_mb, split=False)
            return
        module0, inputs0, criterion0, labels0 = self._pre_forward(f_stage, f_mb)
        roots, grads = self._pre_backward(b_stage, b_mb)
        is_loss = self.schedule.is_last(b_stage)
        loss1 = roots[0] if is_loss and roots else None
        # tuples, as DeepSeek's DualPipe passes them (its run_backward hands them to the autograd
        # engine, which takes tuples only)
        outputs1, output_grads1 = ([], []) if is_loss else (tuple(roots), tuple(grads))
        outputs0, loss0 = hook(
            module0, inputs0, criterion0, list(labels0), m1, loss1, outputs1, output_grads1
        )
        self._post_forward(f_stage, f_mb, as_tuple(outputs0), loss0)
        self._post_backward(b_stage, b_mb)

    # --- step ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        for module in self.modules.values():
            for p in module.parameters():
                return p.device
        return torch.device("cpu")

    def step(
        self,
        inputs: Mapping[int, Sequence[torch.Tensor]],
        labels: Mapping[int, Sequence[torch.Tensor]] | None = None,
        criterion: Callable | None = None,
        return_outputs: bool = False,
    ) -> tuple[dict[int, torch.Tensor], dict[int, tuple[torch.Tensor, ...]]]:
        """Run this rank's actions once.

        Args:
            inputs: ``{micro-batch: input tensors}`` for the micro-batches whose first stage is here.
            labels: ``{micro-batch: label tensors}`` for the micro-batches whose last stage is here.
            criterion: ``criterion(*outputs, *labels) -> scalar loss`` on last stages.
            return_outputs: also return last-stage outputs.

        Returns ``({micro-batch: loss}, {micro-batch: outputs})`` for the last stages on this rank.
        ``self.timings[i]`` is then ``(start, end)`` in seconds from the step's start of action ``i``
        (waiting for its inputs included).
        Under ``torch.no_grad()`` only forwards run. Gradients accumulate in the modules' ``.grad``.
        """
        self._forward_only = not torch.is_grad_enabled()
        self._device = self.device
        self._user_inputs = {m: as_tuple(v) for m, v in inputs.items()}
        self._labels = {m: as_tuple(v) for m, v in (labels or {}).items()}
        self._criterion = criterion
        self._return_outputs = return_outputs
        self._recvs: dict[tuple[str, int, int], _Recv] = {}
        self._local: dict[tuple[str, int, int], tuple] = {}
        self._inputs: dict[tuple[int, int], tuple] = {}
        self._roots: dict[tuple[int, int], tuple] = {}
        self._deferred: dict[tuple[int, int], tuple] = {}
        self._sends: list = []
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.timings: list[tuple[float, float]] = []
        actions = self.schedule.actions[self.rank]
        clock = time.perf_counter
        origin = clock()
        try:
            for k, action in enumerate(actions):
                for ahead in actions[k : k + 1 + self.lookahead]:
                    self._post_receives(ahead)
                t0 = clock() - origin
                if action.kind == "F":
                    self._forward(action.stage, action.mb)
                elif self._forward_only:
                    if action.kind == "FB":
                        self._forward(action.stage, action.mb)
                elif action.kind == "FB":
                    self._forward_backward(action)
                elif action.kind in ("B", "I"):
                    self._backward(action.stage, action.mb, split=action.kind == "I")
                else:
                    self._weight(action.stage, action.mb)
                self.timings.append((t0, clock() - origin))
                self._release_sends()
            for work, _ in self._sends:
                work.wait()
        finally:
            self._sends = []
            self._recvs, self._local, self._inputs, self._roots, self._deferred = {}, {}, {}, {}, {}
            self._user_inputs, self._labels = {}, {}
        return self.losses, self.outputs
