"""Train a small model for a few steps with DualPipe (moeinfra's runtime), on CPU (gloo) or GPU (NCCL).

    .venv/bin/torchrun --nproc-per-node 4 examples/pipeline_dualpipe_torchrun.py [--steps 5]

Every rank holds two stages: stage ``rank`` of the copy that starts at rank 0, and stage
``PP-1-rank`` of the mirrored copy that starts at rank ``PP-1``. Both copies start from the same
weights; ``sync_mirrored_grads`` sums their gradients before each optimiser step so they stay equal.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch import nn

from moeinfra.pipeline.runtime import DualPipe, run_backward

HIDDEN = 64
MICRO_BATCH = 4


class Block(nn.Module):
    """One pipeline stage: a residual MLP block made of plain nn.Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))

    @classmethod
    def overlapped_forward_backward(
        cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1
    ):
        """DeepSeek's hook: forward one chunk while the other's backward runs. On GPU one would issue
        them on two streams; here they simply run one after the other."""
        outputs0 = [module0(*inputs0)]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            run_backward(outputs1, output_grads1)
        return outputs0, loss0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--chunks", type=int, default=0, help="micro-batches per step (default 2 * world size)"
    )
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, pp = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if backend == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    num_chunks = args.chunks or 2 * pp
    batch = num_chunks // 2 * MICRO_BATCH  # per direction

    torch.manual_seed(0)  # the same full model on every rank; each keeps its two stages
    full = [Block() for _ in range(pp)]
    modules = (copy.deepcopy(full[rank]).to(device), copy.deepcopy(full[pp - 1 - rank]).to(device))
    model = DualPipe(modules, p2p_specs=[((MICRO_BATCH, HIDDEN), torch.float32)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.MSELoss()

    # A fixed regression task: learn y = sin(x W) from random x.
    g = torch.Generator().manual_seed(1)
    target_w = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
    for step in range(args.steps):
        x = torch.randn(batch, HIDDEN, generator=g)
        y = torch.sin(x @ target_w)
        x_other = torch.randn(batch, HIDDEN, generator=g)
        y_other = torch.sin(x_other @ target_w)
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:  # inputs enter here; labels are for the inputs entering at the last rank
            loss, _ = model.step(
                x.to(device),
                num_chunks=num_chunks,
                criterion=criterion,
                labels=(y_other.to(device),),
            )
        elif rank == pp - 1:
            loss, _ = model.step(
                x_other.to(device),
                num_chunks=num_chunks,
                criterion=criterion,
                labels=(y.to(device),),
            )
        else:
            loss, _ = model.step(num_chunks=num_chunks)
        model.sync_mirrored_grads()
        optimizer.step()
        if loss is not None:
            print(f"rank {rank} step {step}: mean loss {loss.mean().item():.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
