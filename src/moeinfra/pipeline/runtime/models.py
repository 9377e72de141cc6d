"""User-facing pipeline runners with DeepSeek's calling convention, all on :class:`ScheduleExecutor`.

``DualPipe`` / ``DualPipeV`` take the rank's two stage modules, ``OneFOneB`` / ``ZB1P`` / ``GPipe``
its one stage module. ``step(*inputs, num_chunks=, criterion=, labels=, return_outputs=)`` returns
``(loss, outputs)`` like DeepSeek's DualPipe: ``loss`` is the stacked per-micro-batch losses on the
rank(s) that compute the loss (``None`` elsewhere), ``outputs`` the gathered last-stage outputs when
``return_outputs=True``.

Tensors sent between stages are declared per model stage with ``p2p_specs``: a list of
``(shape, dtype)`` for one micro-batch, used for every stage boundary, or a dict
``{model_stage: [(shape, dtype), ...]}`` giving what each model stage receives (``model_stage >= 1``).
A runner without ``p2p_specs`` uses what DeepSeek's calls set for the whole process,
:func:`set_p2p_tensor_shapes` and :func:`set_p2p_tensor_dtype`, read at each ``step``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from moeinfra.errors import InputError
from moeinfra.pipeline.generators import dualpipe, dualpipev, gpipe, one_f_one_b, zb1p
from moeinfra.pipeline.runtime.executor import ScheduleExecutor, TensorSpec, as_tuple
from moeinfra.pipeline.schedule import Schedule

P2PSpecs = Sequence[TensorSpec] | Mapping[int, Sequence[TensorSpec]]

# DeepSeek's dualpipe.utils keeps these per process; runners without p2p_specs read them
_p2p_shapes: list[tuple[int, ...]] | None = None
_p2p_dtype: torch.dtype | None = None


def set_p2p_tensor_shapes(shapes: Sequence[Sequence[int]]) -> None:
    """DeepSeek's call: the shapes of the tensors every stage boundary exchanges, per micro-batch
    (for runners built without ``p2p_specs``; with :func:`set_p2p_tensor_dtype`)."""
    global _p2p_shapes
    _p2p_shapes = [tuple(int(d) for d in shape) for shape in shapes]


def set_p2p_tensor_dtype(dtype: torch.dtype) -> None:
    """DeepSeek's call: the dtype of the tensors stage boundaries exchange (see
    :func:`set_p2p_tensor_shapes`)."""
    global _p2p_dtype
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"dtype={dtype!r} must be a torch.dtype")
    _p2p_dtype = dtype


def _norm_spec(spec: Sequence) -> TensorSpec:
    shape, dtype = spec
    return (tuple(int(d) for d in shape), dtype)


def scatter(
    tensors: Sequence[torch.Tensor], num_chunks: int, dim: int
) -> list[tuple[torch.Tensor, ...]]:
    """Split each tensor into ``num_chunks`` equal micro-batches along ``dim``: ``[num_chunks]`` tuples."""
    if not tensors:
        return [() for _ in range(num_chunks)]
    for t in tensors:
        if t.shape[dim] % num_chunks:
            raise InputError(
                f"batch size {t.shape[dim]} (dim {dim}) must be a multiple of num_chunks={num_chunks}"
            )
    parts = [t.chunk(num_chunks, dim=dim) for t in tensors]
    return [tuple(p[i] for p in parts) for i in range(num_chunks)]


def gather(chunks: Sequence[tuple[torch.Tensor, ...]], dim: int) -> tuple[torch.Tensor, ...]:
    """Concatenate per-micro-batch output tuples back into whole-batch tensors."""
    return tuple(torch.cat([c[i] for c in chunks], dim=dim) for i in range(len(chunks[0])))


class _Runner(nn.Module):
    """Shared machinery: process group, rank mapping, p2p specs, executor per schedule."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        *,
        batch_dim: int = 0,
        process_group: dist.ProcessGroup | None = None,
        rank_mapping: Sequence[int] | None = None,
        p2p_specs: P2PSpecs | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise InputError(
                "torch.distributed is not initialised: call dist.init_process_group first"
            )
        self.module = nn.ModuleList(modules)
        self.batch_dim = batch_dim
        self.group = process_group
        self.num_ranks = dist.get_world_size(process_group)
        if rank_mapping is None:
            rank_mapping = list(range(self.num_ranks))
        if sorted(rank_mapping) != list(range(self.num_ranks)):
            raise InputError(
                f"rank_mapping={list(rank_mapping)} must be a permutation of 0..{self.num_ranks - 1}"
            )
        # rank_mapping[group rank] = pipeline rank (DeepSeek's convention).
        self.rank = rank_mapping[dist.get_rank(process_group)]
        self.group_ranks = [0] * self.num_ranks
        for group_rank, pp_rank in enumerate(rank_mapping):
            self.group_ranks[pp_rank] = group_rank
        self._specs: P2PSpecs | None = None
        if p2p_specs is not None:
            self.set_p2p_specs(p2p_specs)
        self._executors: dict[int, ScheduleExecutor] = {}

    def set_p2p_specs(self, specs: P2PSpecs) -> None:
        """Declare the tensors stages exchange (per micro-batch); see the module docstring."""
        if isinstance(specs, Mapping):
            self._specs = {int(k): [_norm_spec(s) for s in v] for k, v in specs.items()}
        else:
            self._specs = [_norm_spec(s) for s in specs]

    def _input_specs(self, model_stage: int) -> Sequence[TensorSpec]:
        if self._specs is None:
            if _p2p_shapes is not None and _p2p_dtype is not None:
                return [(shape, _p2p_dtype) for shape in _p2p_shapes]
            raise InputError(
                "p2p_specs are not set: pass p2p_specs=[(shape, dtype), ...], call set_p2p_specs, "
                "or DeepSeek's set_p2p_tensor_shapes and set_p2p_tensor_dtype"
            )
        if isinstance(self._specs, dict):
            if model_stage not in self._specs:
                raise InputError(f"p2p_specs has no entry for model stage {model_stage}")
            return self._specs[model_stage]
        return self._specs

    def _schedule(self, num_chunks: int) -> Schedule:
        raise NotImplementedError

    def _stage_modules(self, schedule: Schedule) -> dict[int, nn.Module]:
        raise NotImplementedError

    def executor(self, num_chunks: int) -> ScheduleExecutor:
        """The executor (and so the :class:`Schedule`) used for ``num_chunks`` micro-batches."""
        if num_chunks not in self._executors:
            schedule = self._schedule(num_chunks)
            # Fail before any communication when a needed spec is missing.
            for stage in schedule.stages_on(self.rank):
                for neighbour in (stage, schedule.next_stage(stage)):
                    if neighbour is not None and not schedule.is_first(neighbour):
                        self._input_specs(schedule.model_stage(neighbour))
            self._executors[num_chunks] = ScheduleExecutor(
                schedule,
                self.rank,
                self._stage_modules(schedule),
                self._input_specs,
                group=self.group,
                group_ranks=self.group_ranks,
            )
        return self._executors[num_chunks]

    def _check_chunks(self, num_chunks: int) -> None:
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise InputError(f"num_chunks={num_chunks!r} must be a positive integer")


class _SingleStage(_Runner):
    """One stage per rank (GPipe, 1F1B, ZB1P): inputs on rank 0, labels / loss / outputs on the last rank."""

    _generator: Callable[[int, int], Schedule]

    def __init__(self, module: nn.Module, **kwargs) -> None:
        super().__init__([module], **kwargs)

    def _schedule(self, num_chunks: int) -> Schedule:
        return type(self)._generator(self.num_ranks, num_chunks)

    def _stage_modules(self, schedule: Schedule) -> dict[int, nn.Module]:
        return {self.rank: self.module[0]}

    def step(
        self,
        *inputs: torch.Tensor,
        num_chunks: int = 0,
        criterion: Callable | None = None,
        labels: Sequence[torch.Tensor] = (),
        return_outputs: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | tuple[torch.Tensor, ...] | None]:
        """One training (or, under ``torch.no_grad()``, inference) step over ``num_chunks`` micro-batches."""
        self._check_chunks(num_chunks)
        ex = self.executor(num_chunks)
        first, last = self.rank == 0, self.rank == self.num_ranks - 1
        ins = dict(enumerate(scatter(inputs, num_chunks, self.batch_dim))) if first else {}
        labs = dict(enumerate(scatter(tuple(labels), num_chunks, self.batch_dim))) if last else {}
        if first and not inputs:
            raise InputError("inputs are required on the first rank")
        losses, outs = ex.step(ins, labs, criterion if last else None, return_outputs)
        return _collect(
            losses, outs, range(num_chunks), last, criterion, return_outputs, self.batch_dim
        )


def _collect(losses, outs, mbs, here: bool, criterion, return_outputs: bool, dim: int):
    loss = outputs = None
    mbs = list(mbs)
    if here and criterion is not None and losses:
        loss = torch.stack([losses[m] for m in mbs])
    if here and return_outputs and outs:
        outputs = gather([outs[m] for m in mbs], dim)
        if len(outputs) == 1:
            outputs = outputs[0]
    return loss, outputs


class GPipe(_SingleStage):
    """GPipe through the schedule executor."""

    _generator = staticmethod(gpipe)


class OneFOneB(_SingleStage):
    """1F1B through the schedule executor."""

    _generator = staticmethod(one_f_one_b)


class ZB1P(_SingleStage):
    """Zero-bubble H1 (deferred weight gradients with plain layers) through the schedule executor."""

    _generator = staticmethod(zb1p)


class DualPipe(_Runner):
    """DeepSeek's DualPipe on ``PP`` ranks: ``modules = (stage rank, stage PP-1-rank)`` of the model.

    Rank 0's inputs enter the first direction and rank ``PP-1``'s the mirrored one; labels on the first
    rank belong to inputs of the last rank and vice versa (as DeepSeek's). Each model stage exists twice
    (``modules[0]`` on rank ``k`` and ``modules[1]`` on rank ``PP-1-k``): after the steps of an update,
    call :meth:`sync_mirrored_grads` once so both copies hold the summed gradient.
    """

    def __init__(self, modules: tuple[nn.Module, nn.Module], **kwargs) -> None:
        if len(modules) != 2:
            raise InputError(
                f"modules has {len(modules)} entries; DualPipe needs 2 (stage rank, stage PP-1-rank)"
            )
        super().__init__(modules, **kwargs)
        if self.num_ranks % 2:
            raise InputError(f"DualPipe needs an even number of ranks, got {self.num_ranks}")
        self.overlapped_forward_backward = type(modules[0]) is type(modules[1]) and hasattr(
            type(modules[0]), "overlapped_forward_backward"
        )

    def _schedule(self, num_chunks: int) -> Schedule:
        return dualpipe(self.num_ranks, num_chunks)

    def _stage_modules(self, schedule: Schedule) -> dict[int, nn.Module]:
        pp = self.num_ranks
        return {self.rank: self.module[0], pp + (pp - 1 - self.rank): self.module[1]}

    def step(
        self,
        *inputs: torch.Tensor,
        num_chunks: int = 0,
        criterion: Callable | None = None,
        labels: Sequence[torch.Tensor] = (),
        return_outputs: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | tuple[torch.Tensor, ...] | None]:
        """One step over ``num_chunks`` micro-batches in total (half enter at each end).

        ``inputs``/``labels``/``criterion`` are needed on the first and last ranks only. Returns
        ``(loss, outputs)``: on the first rank for the inputs of the last rank and vice versa.
        """
        self._check_chunks(num_chunks)
        ex = self.executor(num_chunks)
        pp, half = self.num_ranks, num_chunks // 2
        first, last = self.rank == 0, self.rank == pp - 1
        if (first or last) and not inputs:
            raise InputError("inputs are required on the first and last ranks")
        if (first or last) and torch.is_grad_enabled() and criterion is None:
            raise InputError(
                "criterion is required on the first and last ranks for a training step"
            )
        ins, labs = {}, {}
        # Direction 0 (micro-batches 0..half-1) enters at rank 0 and ends at rank PP-1; direction 1 the reverse.
        if first:
            ins = dict(enumerate(scatter(inputs, half, self.batch_dim)))
            labs = {half + i: c for i, c in enumerate(scatter(tuple(labels), half, self.batch_dim))}
        if last:
            ins.update({half + i: c for i, c in enumerate(scatter(inputs, half, self.batch_dim))})
            labs.update(dict(enumerate(scatter(tuple(labels), half, self.batch_dim))))
        losses, outs = ex.step(ins, labs, criterion if first or last else None, return_outputs)
        mbs = range(half, num_chunks) if first else range(half)
        return _collect(losses, outs, mbs, first or last, criterion, return_outputs, self.batch_dim)

    def sync_mirrored_grads(self) -> None:
        """Sum the gradients of the two copies of every model stage (ranks ``k`` and ``PP-1-k``).

        Call once per optimiser step, after all ``step`` calls of that update; both copies then hold
        the gradient of the whole batch, equal to a single-copy model's.
        """
        partner = self.num_ranks - 1 - self.rank
        flat = [_flat_grad(self.module[0]), _flat_grad(self.module[1])]
        got = [torch.empty_like(flat[1]), torch.empty_like(flat[0])]
        # Our copy 0 (model stage r) pairs with the partner's copy 1, and the other way round.
        peer = self.group_ranks[partner]
        works = [
            dist.isend(flat[0], group=self.group, group_dst=peer, tag=1),
            dist.isend(flat[1], group=self.group, group_dst=peer, tag=2),
            dist.irecv(got[0], group=self.group, group_src=peer, tag=2),
            dist.irecv(got[1], group=self.group, group_src=peer, tag=1),
        ]
        for w in works:
            w.wait()
        _add_flat_grad(self.module[0], got[0])
        _add_flat_grad(self.module[1], got[1])


def _flat_grad(module: nn.Module) -> torch.Tensor:
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
        for p in module.parameters()
    ]
    return torch.cat(parts) if parts else torch.zeros(0)


def _add_flat_grad(module: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in module.parameters():
            n = p.numel()
            g = flat[offset : offset + n].view_as(p)
            p.grad = g.clone() if p.grad is None else p.grad + g
            offset += n


class DualPipeV(_Runner):
    """DeepSeek's DualPipeV on ``P`` ranks: ``modules = (stage rank, stage 2P-1-rank)`` of a 2P-stage model.

    Inputs, labels, loss and outputs all live on rank 0. Odd ``num_chunks`` are allowed (>= 2P).
    """

    def __init__(self, modules: tuple[nn.Module, nn.Module], **kwargs) -> None:
        if len(modules) != 2:
            raise InputError(
                f"modules has {len(modules)} entries; DualPipeV needs 2 (stage rank, stage 2P-1-rank)"
            )
        super().__init__(modules, **kwargs)
        self.overlapped_forward_backward = type(modules[0]) is type(modules[1]) and hasattr(
            type(modules[0]), "overlapped_forward_backward"
        )

    def _schedule(self, num_chunks: int) -> Schedule:
        return dualpipev(self.num_ranks, num_chunks)

    def _stage_modules(self, schedule: Schedule) -> dict[int, nn.Module]:
        return {self.rank: self.module[0], 2 * self.num_ranks - 1 - self.rank: self.module[1]}

    def step(
        self,
        *inputs: torch.Tensor,
        num_chunks: int = 0,
        criterion: Callable | None = None,
        labels: Sequence[torch.Tensor] = (),
        return_outputs: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | tuple[torch.Tensor, ...] | None]:
        """One step over ``num_chunks`` micro-batches; inputs/labels/criterion needed on rank 0 only."""
        self._check_chunks(num_chunks)
        ex = self.executor(num_chunks)
        first = self.rank == 0
        if first and not inputs:
            raise InputError("inputs are required on rank 0")
        if first and torch.is_grad_enabled() and criterion is None:
            raise InputError("criterion is required on rank 0 for a training step")
        ins = dict(enumerate(scatter(inputs, num_chunks, self.batch_dim))) if first else {}
        labs = dict(enumerate(scatter(tuple(labels), num_chunks, self.batch_dim))) if first else {}
        losses, outs = ex.step(ins, labs, criterion if first else None, return_outputs)
        return _collect(
            losses, outs, range(num_chunks), first, criterion, return_outputs, self.batch_dim
        )


__all__ = ["DualPipe", "DualPipeV", "GPipe", "OneFOneB", "ZB1P", "as_tuple", "gather", "scatter"]
