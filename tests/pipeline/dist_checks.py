"""Multi-process checks of the runtime, run by test_runtime.py in spawned gloo process groups.

Every rank builds the same full model from a fixed seed, so each rank can compute the single-process
reference itself and compare its own part. A check returns None when it passes, else a message.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist
from torch import nn

from . import deepseek_convention

H = 8
MB = 2  # micro-batch size


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(H, H)
        self.b = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class OverlapStage(Stage):
    """A stage with DeepSeek's hook (run sequentially here); counts its calls."""

    calls = 0

    @classmethod
    def overlapped_forward_backward(
        cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1
    ):
        cls.calls += 1
        outputs0 = [module0(*inputs0)]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:  # as DeepSeek's dualpipe.utils.run_backward: straight to the engine (tuples only)
            torch.autograd.Variable._execution_engine.run_backward(
                outputs1,
                output_grads1,
                keep_graph=False,
                create_graph=False,
                allow_unreachable=True,
                accumulate_grad=True,
            )
        return outputs0, loss0


def criterion(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, label)


def full_model(num_stages: int, cls: type = Stage) -> list[nn.Module]:
    torch.manual_seed(0)
    return [cls() for _ in range(num_stages)]


def batch(n_chunks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_chunks * MB, H, generator=g), torch.randn(n_chunks * MB, H, generator=g)


def reference(
    stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor, n_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-micro-batch losses (each backpropagated, grads accumulate in ``stages``) and outputs."""
    losses, outs = [], []
    for xc, yc in zip(x.chunk(n_chunks), y.chunk(n_chunks), strict=True):
        h = xc
        for s in stages:
            h = s(h)
        loss = criterion(h, yc)
        if torch.is_grad_enabled():
            loss.backward()
        losses.append(loss.detach())
        outs.append(h.detach())
    return torch.stack(losses), torch.cat(outs)


def grads_match(module: nn.Module, ref: nn.Module) -> str | None:
    for (name, p), q in zip(module.named_parameters(), ref.parameters(), strict=True):
        a, b = p.grad.reshape(-1).double(), q.grad.reshape(-1).double()
        cos = torch.dot(a, b) / (a.norm() * b.norm())
        if not (1 - cos < 1e-10 and torch.allclose(a, b, rtol=1e-5, atol=1e-7)):
            return f"gradient of {name} differs (1-cos={float(1 - cos):.3g})"
    return None


def _specs():
    return [((MB, H), torch.float32)]


def check_dualpipe(
    cls: type = Stage, n_chunks: int | None = None, deepseek_calls: bool = False
) -> str | None:
    from moeinfra.pipeline.dualpipe import DualPipe, set_p2p_tensor_dtype, set_p2p_tensor_shapes

    rank, pp = dist.get_rank(), dist.get_world_size()
    n = n_chunks or 2 * pp
    half = n // 2
    full = full_model(pp, cls)
    stages = (copy.deepcopy(full[rank]), copy.deepcopy(full[pp - 1 - rank]))
    if deepseek_calls:  # as DeepSeek's examples: shapes and dtype set for the process
        model = DualPipe(stages)
        set_p2p_tensor_shapes([(MB, H)])
        set_p2p_tensor_dtype(torch.float32)
    else:
        model = DualPipe(stages, p2p_specs=_specs())
    xa, ya = batch(half, 1)  # enters at rank 0
    xb, yb = batch(half, 2)  # enters at rank PP-1
    args = {}
    if rank == 0:
        args = {"inputs": (xa,), "labels": (yb,)}
    elif rank == pp - 1:
        args = {"inputs": (xb,), "labels": (ya,)}
    loss, out = model.step(
        *args.get("inputs", ()),
        num_chunks=n,
        criterion=criterion,
        labels=args.get("labels", ()),
        return_outputs=True,
    )
    model.sync_mirrored_grads()
    ref_a_loss, ref_a_out = reference(full, xa, ya, half)
    ref_b_loss, ref_b_out = reference(full, xb, yb, half)  # same stages, second copy's data
    if rank == 0 and not (torch.equal(loss, ref_b_loss) and torch.equal(out, ref_b_out)):
        return f"rank 0 loss {loss} != reference {ref_b_loss}"
    if rank == pp - 1 and not (torch.equal(loss, ref_a_loss) and torch.equal(out, ref_a_out)):
        return f"rank {rank} loss {loss} != reference {ref_a_loss}"
    if rank not in (0, pp - 1) and (loss is not None or out is not None):
        return "middle rank returned a loss"
    err = grads_match(model.module[0], full[rank]) or grads_match(
        model.module[1], full[pp - 1 - rank]
    )
    if err:
        return err
    # Inference: the same outputs, no gradients.
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        _, out = model.step(*args.get("inputs", ()), num_chunks=n, return_outputs=True)
    expected = ref_b_out if rank == 0 else ref_a_out if rank == pp - 1 else None
    if expected is not None and not torch.equal(out, expected):
        return "inference outputs differ from the reference"
    if any(q.grad is not None for q in model.parameters()):
        return "inference produced gradients"
    return None


def check_with_deepseek_calls() -> str | None:
    from moeinfra.pipeline.runtime import models

    try:
        return check_dualpipe(deepseek_calls=True)
    finally:  # the setters hold for the process: leave it as the other checks expect
        models._p2p_shapes = models._p2p_dtype = None


def check_deepseek_script(main) -> str | None:
    """One of deepseek_convention's scripts on this process group."""
    from moeinfra.pipeline.runtime import models

    try:
        return main(dist.get_rank(), dist.get_world_size())
    finally:
        models._p2p_shapes = models._p2p_dtype = None


def check_dualpipe_overlap_hook() -> str | None:
    OverlapStage.calls = 0
    err = check_dualpipe(OverlapStage, n_chunks=2 * dist.get_world_size() + 2)
    if err is None and OverlapStage.calls == 0:
        return "overlapped_forward_backward was never called"
    return err


def check_dualpipev(n_chunks: int) -> str | None:
    from moeinfra.pipeline.runtime import DualPipeV

    rank, p = dist.get_rank(), dist.get_world_size()
    full = full_model(2 * p)
    model = DualPipeV(
        (copy.deepcopy(full[rank]), copy.deepcopy(full[2 * p - 1 - rank])),
        p2p_specs={k: _specs() for k in range(1, 2 * p)},
    )
    x, y = batch(n_chunks, 3)
    if rank == 0:
        loss, _ = model.step(x, num_chunks=n_chunks, criterion=criterion, labels=(y,))
    else:
        loss, _ = model.step(num_chunks=n_chunks)
    ref_loss, ref_out = reference(full, x, y, n_chunks)
    if rank == 0 and not torch.equal(loss, ref_loss):
        return f"loss {loss} != reference {ref_loss}"
    err = grads_match(model.module[0], full[rank]) or grads_match(
        model.module[1], full[2 * p - 1 - rank]
    )
    if err:
        return err
    # Inference: outputs equal, no gradients touched.
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        out = (
            model.step(x, num_chunks=n_chunks, return_outputs=True)[1]
            if rank == 0
            else model.step(num_chunks=n_chunks)[1]
        )
    if rank == 0 and not torch.equal(out, ref_out):
        return "inference outputs differ from the reference"
    if any(q.grad is not None for q in model.parameters()):
        return "inference produced gradients"
    return None


def check_single(kind: str, n_chunks: int) -> str | None:
    from moeinfra.pipeline import runtime

    rank, p = dist.get_rank(), dist.get_world_size()
    full = full_model(p)
    model = getattr(runtime, kind)(copy.deepcopy(full[rank]), p2p_specs=_specs())
    x, y = batch(n_chunks, 4)
    ins = (x,) if rank == 0 else ()
    labels = (y,) if rank == p - 1 else ()
    loss, out = model.step(
        *ins, num_chunks=n_chunks, criterion=criterion, labels=labels, return_outputs=True
    )
    ref_loss, ref_out = reference(full, x, y, n_chunks)
    if rank == p - 1 and not (torch.equal(loss, ref_loss) and torch.equal(out, ref_out)):
        return f"{kind}: loss {loss} != reference {ref_loss}"
    err = grads_match(model.module[0], full[rank])
    return f"{kind}: {err}" if err else None


def check_bad_arguments() -> str | None:
    from moeinfra.errors import InputError
    from moeinfra.pipeline.runtime import DualPipe, DualPipeV

    rank, p = dist.get_rank(), dist.get_world_size()
    cases = [
        (
            lambda: DualPipe((Stage(), Stage()), p2p_specs=_specs()).step(
                *batch(1, 0)[:1], num_chunks=3, criterion=criterion
            ),
            "num_microbatches=3",
        ),
        (lambda: DualPipeV((Stage(),)), "DualPipeV needs 2"),
        (
            lambda: DualPipeV((Stage(), Stage())).step(
                *batch(2 * p, 0)[:1], num_chunks=2 * p, criterion=criterion
            ),
            "p2p_specs are not set",
        ),
        (
            lambda: DualPipeV((Stage(), Stage()), p2p_specs=_specs()).step(
                torch.zeros(3, H), num_chunks=2 * p, criterion=criterion
            ),
            "multiple of num_chunks",
        ),
        (lambda: DualPipe((Stage(), Stage()), rank_mapping=[0, 0]), "rank_mapping"),
    ]
    for fn, match in cases:
        if rank != 0 and "multiple of" in match:
            continue  # only rank 0 scatters inputs; the other ranks would wait for it
        try:
            fn()
        except InputError as exc:
            if match not in str(exc):
                return f"expected {match!r} in {exc}"
        else:
            return f"no error for case {match!r}"
    return None


def looped_schedule(p: int, m: int):
    """A hand-made schedule on a looped layout (stage s on rank s % p, 2p stages): all forwards,
    then all backwards, with the last chunk's backward split into I and W."""
    from moeinfra.pipeline import Action, Schedule, validate

    actions = []
    for r in range(p):
        acts = [Action("F", c * p + r, mb) for c in (0, 1) for mb in range(m)]
        acts += [Action("I", p + r, mb) for mb in range(m)] + [
            Action("W", p + r, mb) for mb in range(m)
        ]
        acts += [Action("B", r, mb) for mb in range(m)]
        actions.append(tuple(acts))
    schedule = Schedule(
        "looped",
        p,
        tuple(s % p for s in range(2 * p)),
        (tuple(range(2 * p)),),
        (0,) * m,
        tuple(actions),
    )
    validate(schedule)
    return schedule


def check_executor_custom_schedule() -> str | None:
    from moeinfra.pipeline.runtime import ScheduleExecutor

    rank, p = dist.get_rank(), dist.get_world_size()
    m = 3
    full = full_model(2 * p)
    schedule = looped_schedule(p, m)
    mine = {s: copy.deepcopy(full[s]) for s in schedule.stages_on(rank)}
    ex = ScheduleExecutor(schedule, rank, mine, lambda k: _specs())
    x, y = batch(m, 5)
    ins = dict(enumerate((c,) for c in x.chunk(m))) if rank == 0 else {}
    labels = dict(enumerate((c,) for c in y.chunk(m))) if schedule.stage_ranks[-1] == rank else {}
    losses, _ = ex.step(ins, labels, criterion)
    ref_loss, _ = reference(full, x, y, m)
    if labels and not torch.equal(torch.stack([losses[i] for i in range(m)]), ref_loss):
        return "custom schedule: losses differ"
    for s, module in mine.items():
        err = grads_match(module, full[s])
        if err:
            return f"custom schedule stage {s}: {err}"
    return None


CHECKS = {
    "dualpipe": check_dualpipe,
    "dualpipe_more_chunks": lambda: check_dualpipe(n_chunks=2 * dist.get_world_size() + 4),
    "dualpipe_overlap_hook": check_dualpipe_overlap_hook,
    "dualpipe_deepseek_calls": check_with_deepseek_calls,
    "dualpipev_odd": lambda: check_dualpipev(2 * dist.get_world_size() + 1),
    "1f1b": lambda: check_single("OneFOneB", 6),
    "zb1p": lambda: check_single("ZB1P", 6),
    "gpipe": lambda: check_single("GPipe", 5),
    "custom_schedule": check_executor_custom_schedule,
    "deepseek_script_dualpipe": lambda: check_deepseek_script(deepseek_convention.main_dualpipe),
    "deepseek_script_dualpipev": lambda: check_deepseek_script(deepseek_convention.main_dualpipev),
    "bad_arguments": check_bad_arguments,
}


def _rank_checks(names: list[str]) -> dict[str, str | None]:
    """Run ``names`` on this rank, in step with the others; ``{check: error or None}``."""
    results = {}
    for name in names:
        try:
            results[name] = CHECKS[name]()
        except Exception:  # report, do not hang the others
            results[name] = traceback.format_exc(limit=4)
        dist.barrier()
    return results


def run_checks(world: int, names: list[str], timeout_s: float = 60.0) -> dict[str, list[str]]:
    """Run ``names`` on ``world`` spawned ranks; return ``{check: [failure messages]}`` (empty = pass)."""
    from moeinfra.moe.launch import launch

    results: dict[str, list[str]] = {n: [] for n in names}
    for rank, errors in enumerate(launch(world, _rank_checks, (names,), timeout_s=timeout_s)):
        for name, err in errors.items():
            if err:
                results[name].append(f"rank {rank}: {err}")
    return results
