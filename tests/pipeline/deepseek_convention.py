"""Scripts in the calling convention of DeepSeek's DualPipe examples, with only the import line
changed (``from dualpipe import ...`` -> ``from moeinfra.pipeline.dualpipe import ...``) and gloo/CPU
for NCCL/CUDA: a stage of custom autograd linears that defer their weight gradient to the
``WeightGradStore`` (DeepSeek's zero-bubble protocol), DeepSeek's overlap hook with ``run_backward``,
shapes set with ``set_p2p_tensor_shapes`` / ``set_p2p_tensor_dtype``, ``step(x, num_chunks=,
criterion=, labels=(l,), return_outputs=)`` with ``None`` on the ranks that hold no data, and
gradients of the mirrored DualPipe copies summed the way DeepSeek's example sums them.

Run by test_runtime.py through dist_checks.CHECKS (the process group is already initialised).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from moeinfra.pipeline.dualpipe import (
    DualPipe,
    DualPipeV,
    WeightGradStore,
    run_backward,
    set_p2p_tensor_dtype,
    set_p2p_tensor_shapes,
)

NUM_CHUNKS, MICRO_BATCH, SEQ, HIDDEN = 20, 3, 4, 8


class LinearFunc(torch.autograd.Function):
    deferred = 0  # weight gradients put in the store (the zero-bubble path really ran)

    @staticmethod
    def forward(ctx, input, weight):
        ctx.save_for_backward(input, weight)
        return F.linear(input, weight)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)

        def grad_weight_fn():
            weight.grad += grad_output.flatten(0, -2).T @ input.flatten(0, -2)

        if WeightGradStore.enabled:
            LinearFunc.deferred += 1
            WeightGradStore.put(grad_weight_fn)
        else:
            grad_weight_fn()
        return grad_output @ weight, None


class MyLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return LinearFunc.apply(input, self.weight)


class PipelineStage(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear1 = MyLinear(hidden_size, hidden_size * 4, bias=False)
        self.linear2 = MyLinear(hidden_size * 4, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(x)))

    @classmethod
    def overlapped_forward_backward(
        cls,
        module0: PipelineStage,
        inputs0: list[torch.Tensor],
        criterion0: Callable | None,
        labels0: list[torch.Tensor] | None,
        module1: PipelineStage,
        loss1: torch.Tensor | None,
        outputs1: list[torch.Tensor] | None,
        output_grads1: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        outputs0 = module0(*inputs0)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            run_backward(outputs1, output_grads1)
        return outputs0, loss0


def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target).clone()


def ref_step(x, l, model, chunks):  # noqa: E741 (DeepSeek's names)
    ys, losses = [], []
    for micro_x, micro_l in zip(x.chunk(chunks), l.chunk(chunks), strict=True):
        micro_y = model(micro_x)
        loss = criterion(micro_y, micro_l)
        loss.backward()
        ys.append(micro_y)
        losses.append(loss)
    return torch.stack(losses), torch.cat(ys, 0)


def cal_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum().item() / (x * x + y * y).sum().item()


def _deferred_anywhere() -> bool:
    count = torch.tensor([LinearFunc.deferred])
    dist.all_reduce(count)
    return int(count) > 0


def main_dualpipe(rank: int, pp_size: int) -> str | None:
    is_first_rank, is_last_rank = rank == 0, rank == pp_size - 1
    torch.manual_seed(233)
    LinearFunc.deferred = 0
    set_p2p_tensor_shapes([(MICRO_BATCH, SEQ, HIDDEN)])
    set_p2p_tensor_dtype(torch.float32)
    full_modules = nn.Sequential(*[PipelineStage(HIDDEN) for _ in range(pp_size)])
    full_x = torch.randn(NUM_CHUNKS * MICRO_BATCH, SEQ, HIDDEN)
    full_l = torch.randn(NUM_CHUNKS * MICRO_BATCH, SEQ, HIDDEN)
    loss_ref, output_ref = ref_step(full_x, full_l, full_modules, NUM_CHUNKS)

    local_full_modules = nn.Sequential(full_modules[rank], full_modules[pp_size - 1 - rank])
    local_modules = nn.Sequential(PipelineStage(HIDDEN), PipelineStage(HIDDEN))
    local_modules[0].load_state_dict(local_full_modules[0].state_dict())
    local_modules[1].load_state_dict(local_full_modules[1].state_dict())
    dualpipe_model = DualPipe(local_modules)
    if is_first_rank:
        x, l = full_x.chunk(2)[0], full_l.chunk(2)[1]  # noqa: E741
    elif is_last_rank:
        x, l = full_x.chunk(2)[1], full_l.chunk(2)[0]  # noqa: E741
    else:
        x = l = None  # noqa: E741

    loss, outputs = dualpipe_model.step(
        x, num_chunks=NUM_CHUNKS, criterion=criterion, labels=(l,), return_outputs=False
    )
    if is_first_rank and not torch.equal(loss, loss_ref.chunk(2)[1]):
        return "DualPipe: rank 0 loss differs from the reference"
    if is_last_rank and not torch.equal(loss, loss_ref.chunk(2)[0]):
        return "DualPipe: last rank loss differs from the reference"
    if not (is_first_rank or is_last_rank) and loss is not None:
        return "DualPipe: a middle rank returned a loss"
    if outputs is not None:
        return "DualPipe: outputs returned without return_outputs"
    # On 2 ranks DualPipe splits only first stages' backwards, and those run whole at W.
    if pp_size > 2 and not _deferred_anywhere():
        return "DualPipe: no weight gradient went through the WeightGradStore"
    # The mirrored copies' gradients summed as DeepSeek's example does (all_gather_into_tensor is
    # NCCL's; gloo gathers into a list).
    for p0, p1 in zip(local_modules[0].parameters(), local_modules[1].parameters(), strict=True):
        p0all = [torch.empty_like(p0) for _ in range(pp_size)]
        p1all = [torch.empty_like(p1) for _ in range(pp_size)]
        dist.all_gather(p0all, p0.grad)
        dist.all_gather(p1all, p1.grad)
        p0.grad += p1all[pp_size - 1 - rank]
        p1.grad += p0all[pp_size - 1 - rank]
    for (n, p), p_ref in zip(
        local_modules.named_parameters(), local_full_modules.parameters(), strict=True
    ):
        if not cal_diff(p.grad, p_ref.grad) < 1e-13:
            return (
                f"DualPipe: gradient of {n} differs (cal_diff {cal_diff(p.grad, p_ref.grad):.3g})"
            )
    dualpipe_model.zero_grad()

    with torch.no_grad():
        loss, outputs = dualpipe_model.step(
            x, num_chunks=NUM_CHUNKS, criterion=criterion, labels=(l,), return_outputs=True
        )
    if is_first_rank and not (
        torch.equal(loss, loss_ref.chunk(2)[1]) and torch.equal(outputs, output_ref.chunk(2)[1])
    ):
        return "DualPipe inference: rank 0 loss or outputs differ"
    if is_last_rank and not (
        torch.equal(loss, loss_ref.chunk(2)[0]) and torch.equal(outputs, output_ref.chunk(2)[0])
    ):
        return "DualPipe inference: last rank loss or outputs differ"
    if not (is_first_rank or is_last_rank) and (loss is not None or outputs is not None):
        return "DualPipe inference: a middle rank returned a loss or outputs"
    return None


def main_dualpipev(rank: int, pp_size: int) -> str | None:
    is_first_rank = rank == 0
    torch.manual_seed(233)
    LinearFunc.deferred = 0
    set_p2p_tensor_shapes([(MICRO_BATCH, SEQ, HIDDEN)])
    set_p2p_tensor_dtype(torch.float32)
    full_modules = nn.Sequential(*[PipelineStage(HIDDEN) for _ in range(pp_size * 2)])
    x = torch.randn(NUM_CHUNKS * MICRO_BATCH, SEQ, HIDDEN)
    l = torch.randn(NUM_CHUNKS * MICRO_BATCH, SEQ, HIDDEN)  # noqa: E741
    loss_ref, output_ref = ref_step(x, l, full_modules, NUM_CHUNKS)

    local_full_modules = nn.Sequential(full_modules[rank], full_modules[pp_size * 2 - 1 - rank])
    local_modules = nn.Sequential(PipelineStage(HIDDEN), PipelineStage(HIDDEN))
    local_modules[0].load_state_dict(local_full_modules[0].state_dict())
    local_modules[1].load_state_dict(local_full_modules[1].state_dict())
    dualpipev_model = DualPipeV(local_modules)
    if not is_first_rank:
        x = l = None  # noqa: E741

    loss, outputs = dualpipev_model.step(
        x, num_chunks=NUM_CHUNKS, criterion=criterion, labels=(l,), return_outputs=False
    )
    if is_first_rank and not torch.equal(loss, loss_ref):
        return "DualPipeV: loss differs from the reference"
    if not is_first_rank and loss is not None:
        return "DualPipeV: a rank other than 0 returned a loss"
    if outputs is not None:
        return "DualPipeV: outputs returned without return_outputs"
    if not _deferred_anywhere():
        return "DualPipeV: no weight gradient went through the WeightGradStore"
    for (n, p), p_ref in zip(
        local_modules.named_parameters(), local_full_modules.parameters(), strict=True
    ):
        if not cal_diff(p.grad, p_ref.grad) < 1e-13:
            return (
                f"DualPipeV: gradient of {n} differs (cal_diff {cal_diff(p.grad, p_ref.grad):.3g})"
            )
    dualpipev_model.zero_grad()

    with torch.no_grad():
        loss, outputs = dualpipev_model.step(
            x, num_chunks=NUM_CHUNKS, criterion=criterion, labels=(l,), return_outputs=True
        )
    if is_first_rank and not (torch.equal(loss, loss_ref) and torch.equal(outputs, output_ref)):
        return "DualPipeV inference: loss or outputs differ"
    if not is_first_rank and (loss is not None or outputs is not None):
        return "DualPipeV inference: a rank other than 0 returned a loss or outputs"
    return None
