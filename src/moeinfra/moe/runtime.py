"""Run a :class:`~moeinfra.moe.block.Decoder` with expert parallelism and an overlap schedule.

Attention, the gate and the shared expert run data-parallel (each rank on its own tokens); the routed
experts run expert-parallel through :class:`~moeinfra.moe.expert_parallel.ExpertParallelMoE`. The
schedule (:mod:`moeinfra.moe.schedules`) says in which order the ops of the two micro-batches run;
waits sit just before the first op that needs an exchange's result, outside the recorded compute
intervals, so the timeline shows true overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeinfra.eplb import Plan
from moeinfra.errors import InputError
from moeinfra.moe.block import Decoder, finish
from moeinfra.moe.comm import Communicator, Pending
from moeinfra.moe.expert_parallel import ExpertParallelMoE, Routed
from moeinfra.moe.mla import KVCache, Segment, positions_of
from moeinfra.moe.schedules import micro_batches, schedule


def attention_cost(start: int, length: int) -> int:
    """Causal attention cost of positions ``start .. start+length-1``: keys attended, summed."""
    end = start + length
    return (end * (end + 1) - start * (start + 1)) // 2


@dataclass(frozen=True)
class Split:
    """Two micro-batches of a rank's tokens: ``rows[m]`` (``[T_m]`` int64 row indices) and
    ``segments[m]``. Micro-batch 1 is attended first in both overlapped schedules, so a sequence split
    between the two has its prefix in micro-batch 1."""

    rows: tuple[torch.Tensor, torch.Tensor]
    segments: tuple[list[Segment], list[Segment]]

    def tokens(self) -> tuple[int, int]:
        return (len(self.rows[0]), len(self.rows[1]))

    def attention_costs(self) -> tuple[int, int]:
        return tuple(sum(attention_cost(s.start, s.length) for s in segs) for segs in self.segments)


def split_micro_batches(segments: list[Segment], allow_split: bool = True) -> Split:
    """Split a batch in two, balanced by token count and by attention cost.

    Sequences, longest first, go to the side with the smaller attention cost; then the token stream
    (side 1's sequences, then side 0's) is cut in the middle — ``allow_split`` (prefill) cuts exactly
    at half the tokens, splitting at most one sequence; otherwise (decode) at the sequence boundary
    closest to the middle.
    """
    offsets, row = [], 0
    for s in segments:
        offsets.append(row)
        row += s.length
    total = row
    cost = [0, 0]
    sides: list[list[int]] = [[], []]
    for i in sorted(range(len(segments)), key=lambda i: -segments[i].length):
        side = 1 if cost[1] <= cost[0] else 0
        sides[side].append(i)
        cost[side] += attention_cost(segments[i].start, segments[i].length)
    stream = sides[1] + sides[0]
    if allow_split:
        cut = (total + 1) // 2
    else:
        bounds, acc = [0], 0
        for i in stream:
            acc += segments[i].length
            bounds.append(acc)
        cut = min(bounds, key=lambda b: (abs(2 * b - total), -b))
    parts: tuple[list, list] = ([], [])
    rows: tuple[list, list] = ([], [])
    acc = 0
    for i in stream:
        s = segments[i]
        head = max(0, min(s.length, cut - acc))
        if head:
            parts[1].append(Segment(s.seq, s.start, head))
            rows[1].append(torch.arange(offsets[i], offsets[i] + head))
        if s.length - head:
            parts[0].append(Segment(s.seq, s.start + head, s.length - head))
            rows[0].append(torch.arange(offsets[i] + head, offsets[i] + s.length))
        acc += s.length

    def cat(r: list) -> torch.Tensor:
        return torch.cat(r) if r else torch.zeros(0, dtype=torch.int64)

    return Split((cat(rows[0]), cat(rows[1])), parts)


@dataclass
class _MicroBatch:
    x: torch.Tensor
    segments: list[Segment]
    projected: object = None
    h: torch.Tensor | None = None
    hn: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    shared: torch.Tensor | None = None
    routed: Routed | None = None
    expert_out: torch.Tensor | None = None
    combine: Pending | None = None


class ExpertParallelDecoder(nn.Module):
    """A :class:`Decoder` whose MoE layers are expert-parallel; ``plan`` has one row per block.

    Any blocks with the :class:`~moeinfra.moe.block.DecoderBlock` stage interface (``attn0``,
    ``attn1`` taking a per-layer cache) can be run, with their EP layers, via :meth:`from_layers` —
    the inference engine runs its paged-cache blocks this way.
    """

    def __init__(self, decoder: Decoder, plan: Plan, comm: Communicator | None = None) -> None:
        super().__init__()
        if plan.num_layers != len(decoder.blocks):
            raise InputError(
                f"plan has {plan.num_layers} layers, the decoder has {len(decoder.blocks)} blocks"
            )
        self.comm = comm or Communicator()
        self.blocks = decoder.blocks
        self.moe = nn.ModuleList(
            ExpertParallelMoE(block.moe, plan, layer, self.comm)
            for layer, block in enumerate(decoder.blocks)
        )

    @classmethod
    def from_layers(
        cls, blocks: nn.ModuleList, moe: nn.ModuleList, comm: Communicator
    ) -> ExpertParallelDecoder:
        """Blocks (attention stages) and their expert-parallel MoE layers, one per block."""
        if len(blocks) != len(moe):
            raise InputError(f"{len(blocks)} blocks but {len(moe)} expert-parallel MoE layers")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.comm, self.blocks, self.moe = comm, blocks, moe
        return self

    def apply_plan(self, plan: Plan) -> int:
        """Migrate every layer to ``plan`` (collective); number of experts this rank received."""
        return sum(layer.apply_plan(plan) for layer in self.moe)

    def set_record_load(self, on: bool) -> None:
        for layer in self.moe:
            layer.record_load = on

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        segments: list[Segment],
        overlap: str = "none",
        caches: list | None = None,
    ) -> torch.Tensor:
        """This rank's tokens ``x [T, H]`` laid out as ``segments`` -> ``[T, H]`` (inference only).

        ``caches``: one cache per block, passed to the blocks' ``attn1`` (default: a fresh
        :class:`KVCache` per block, so every segment must start at position 0).
        """
        if sum(s.length for s in segments) != x.shape[0]:
            raise InputError(
                f"segments cover {sum(s.length for s in segments)} tokens, x has {x.shape[0]} rows"
            )
        if caches is None and any(s.start for s in segments):
            raise InputError(
                "segments must start at position 0 (this runtime has no KV cache of earlier steps); "
                f"got starts {[s.start for s in segments if s.start]}"
            )
        ops = schedule(overlap, len(self.blocks))
        if micro_batches(overlap) == 1:
            rows = torch.arange(x.shape[0], device=x.device)
            split = Split((rows, rows[:0]), (segments, []))
        else:
            split = split_micro_batches(segments, allow_split=overlap == "prefill")
        rows = [r.to(x.device) for r in split.rows]  # a split's rows are built on the host
        mbs = [_MicroBatch(x.index_select(0, rows[m]), split.segments[m]) for m in range(2)]
        rec = self.comm.recorder
        # One cache per layer, shared by the micro-batches: a split sequence's suffix reads its prefix.
        if caches is None:
            caches = [KVCache() for _ in self.blocks]
        blocks, moe = list(self.blocks), list(self.moe)
        label = "op"  # named only for a recorder that keeps them
        for op in ops:
            mb, layer = mbs[op.micro_batch], op.layer
            block, ep = blocks[layer], moe[layer]
            if rec.enabled:
                label = f"{op.kind}(mb{op.micro_batch}) L{layer}"
            if op.kind in ("ATTN", "ATTN0"):
                self._finish_layer(mb, ep_prev=moe[layer - 1] if layer else None, label=label)
                with rec.compute(label):
                    mb.projected = block.attn0(mb.x, mb.segments)
                    if op.kind == "ATTN":
                        self._attn1(block, mb, caches[layer])
            elif op.kind == "ATTN1":
                with rec.compute(label):
                    self._attn1(block, mb, caches[layer])
            elif op.kind == "SHARED":
                with rec.compute(label):
                    mb.shared = ep.shared_output(mb.hn)
            elif op.kind == "DISPATCH":
                mb.routed = ep.dispatch(mb.hn, mb.weights, mb.indices, name=label)
            elif op.kind == "MLP":
                mb.routed.pending.wait()
                with rec.compute(label):
                    mb.expert_out = ep.compute_experts(mb.routed)
            elif op.kind == "COMBINE":
                mb.combine = ep.combine(mb.routed, mb.expert_out, name=label)
        for m, mb in enumerate(mbs):
            self._finish_layer(mb, ep_prev=moe[-1], label=f"OUT(mb{m})")
        out = torch.empty_like(x)
        for m in range(2):
            out.index_copy_(0, rows[m], mbs[m].x)
        return out

    @staticmethod
    def _attn1(block, mb: _MicroBatch, cache: KVCache) -> None:
        mb.h, mb.hn, mb.weights, mb.indices = block.attn1(mb.x, mb.projected, mb.segments, cache)

    def _finish_layer(self, mb: _MicroBatch, ep_prev: ExpertParallelMoE | None, label: str) -> None:
        """Complete the previous layer of ``mb``: wait for its combine, then the residual sum."""
        if mb.combine is None:
            return
        mb.combine.wait()
        with self.comm.recorder.compute(label + ".sum"):
            routed = ep_prev.finish_combine(mb.routed, mb.combine)
            mb.x = finish(mb.h, routed + mb.shared)
        mb.combine = mb.routed = mb.expert_out = None


def reference_forward(decoder: Decoder, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """Single-process reference output ``[T, H]`` (no expert parallelism, no micro-batches)."""
    with torch.no_grad():
        return decoder(x, segments)


__all__ = [
    "ExpertParallelDecoder",
    "Split",
    "attention_cost",
    "positions_of",
    "reference_forward",
    "split_micro_batches",
]
