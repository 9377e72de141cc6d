"""``ExpertParallelMoE``: a DeepSeek-V3 MoE layer with routed experts spread over ranks.

Tokens stay on their (data-parallel) rank. Each routed copy of a token goes to the rank holding the
physical replica that :func:`moeinfra.eplb.replica_for_tokens` picks for it (replicas share an expert's
load evenly), is computed there, and comes back to be summed with its gate weight. The gate and the
shared expert run locally.

Dispatch and combine are split into issue / wait steps so the overlap schedules can run other work in
between: :meth:`dispatch` -> :meth:`compute_experts` -> :meth:`combine` -> :meth:`finish_combine`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from moeinfra.eplb import Plan, migration, replica_for_tokens
from moeinfra.errors import InputError
from moeinfra.moe import cpu_features, cpu_kernels
from moeinfra.moe.comm import Communicator, Pending
from moeinfra.moe.config import MoEConfig
from moeinfra.moe.gate import Gate
from moeinfra.moe.layers import Expert, MoE, combine_pairs, linear, swiglu


@dataclass
class Routed:
    """One micro-batch's routed tokens in flight.

    ``order [P]``: pair index (``token * k + j``) of each sent row, rows sorted by slot;
    ``send_splits [world]``: rows sent to each peer; ``pending``: the dispatch in flight;
    ``weights [T, k]``; ``recv_splits [world]`` rows received from each peer (known after the wait).
    ``pair_slots [T * k]``: set (``order`` None) when the experts run fused with the combine, on
    one rank for a few pairs: the dispatch carries the tokens themselves (not a row per pair; its
    counts per slot as always) and the experts' output is already each token's sum.
    """

    order: torch.Tensor | None
    weights: torch.Tensor
    send_splits: list[int]
    pending: Pending
    name: str
    recv_splits: list[int] | None = None
    pair_slots: torch.Tensor | None = None


def _flat_expert(expert: Expert) -> torch.Tensor:
    """Every parameter's bytes in one uint8 tensor (parameters may differ in dtype: FP8 weights
    beside float32 scales)."""
    return torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in expert.parameters()])


def _load_flat(expert: Expert, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in expert.parameters():
            size = p.numel() * p.element_size()
            p.copy_(flat[offset : offset + size].view(p.dtype).view_as(p))
            offset += size


class ExpertParallelMoE(nn.Module):
    """This rank's part of an expert-parallel MoE layer.

    Args:
        reference: the full MoE (same weights on every rank); this rank keeps the gate, the shared
            expert and copies of the experts of its physical slots.
        plan: EPLB plan; ``plan.phy2log[layer]`` places the ``R`` slots, ``R / world_size`` per rank.
        layer: which row of the plan this layer uses.
        comm: the rank's :class:`Communicator` (default: one on the default group).
    """

    def __init__(
        self, reference: MoE, plan: Plan, layer: int = 0, comm: Communicator | None = None
    ) -> None:
        super().__init__()
        self._place(reference.config, plan, layer, comm)
        self.gate = copy.deepcopy(reference.gate)
        self.shared = copy.deepcopy(reference.shared)
        self.experts = nn.ModuleList(
            copy.deepcopy(reference.experts[e]) for e in self.local_experts()
        )

    @classmethod
    def from_experts(
        cls,
        config: MoEConfig,
        gate: Gate,
        shared: Expert | None,
        experts: Mapping[int, Expert],
        plan: Plan,
        layer: int = 0,
        comm: Communicator | None = None,
    ) -> ExpertParallelMoE:
        """This rank's layer from its own parts only — what a checkpoint loader reads for the rank:
        ``experts`` maps logical expert id to its module and must hold every expert of the rank's
        slots (see :func:`rank_experts`); the modules are used as they are (a slot repeating an
        expert gets a copy)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._place(config, plan, layer, comm)
        missing = sorted(set(self.local_experts()) - set(experts))
        if missing:
            raise InputError(f"experts must hold this rank's experts {missing}")
        self.gate, self.shared = gate, shared
        self.experts = nn.ModuleList(_distinct([experts[e] for e in self.local_experts()]))
        return self

    def _place(self, config: MoEConfig, plan: Plan, layer: int, comm: Communicator | None) -> None:
        self.config = config
        self.comm = comm or Communicator()
        world = self.comm.world_size
        lay = plan.layout
        if lay.num_experts != self.config.num_routed_experts:
            raise InputError(
                f"plan has num_experts={lay.num_experts}, the MoE has "
                f"{self.config.num_routed_experts} routed experts"
            )
        if lay.num_gpus != world:
            raise InputError(
                f"plan is for num_gpus={lay.num_gpus}, the process group has world_size={world}"
            )
        if lay.num_replicas % world:
            raise InputError(
                f"num_replicas={lay.num_replicas} must be a multiple of world_size={world}"
            )
        if not 0 <= layer < plan.num_layers:
            raise InputError(f"layer={layer} must be in 0..{plan.num_layers - 1}")
        self.plan, self.layer = plan, layer
        self.slots_per_rank = lay.num_replicas // world
        self.record_load = False
        self.load_counts = torch.zeros(self.config.num_routed_experts, dtype=torch.int64)
        self._token_offset = self.comm.rank
        self._stack: tuple[torch.Tensor, torch.Tensor] | None = None
        self._slot_table: torch.Tensor | None = None

    def local_experts(self) -> list[int]:
        """Logical expert of each of this rank's slots."""
        s, r = self.slots_per_rank, self.comm.rank
        return [int(e) for e in self.plan.phy2log[self.layer, r * s : (r + 1) * s]]

    # ------------------------------------------------------------------ routing and exchange
    def dispatch(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, name: str = "dispatch"
    ) -> Routed:
        """Issue the dispatch of ``x [T, H]`` routed by ``weights, indices [T, k]`` (async)."""
        num_tokens, top_k = indices.shape
        world, s = self.comm.world_size, self.slots_per_rank
        rec = self.comm.recorder
        with rec.compute(f"{name}.route"):
            if self.record_load:
                if self.load_counts.device != indices.device:  # kept where the routing runs
                    self.load_counts = self.load_counts.to(indices.device)
                self.load_counts += torch.bincount(
                    indices.reshape(-1), minlength=self.config.num_routed_experts
                )
            # Interleaved global token ids (local index * world + rank) need no exchange and differ
            # between ranks, so every rank starts each expert's replicas at a different one.
            slots = self._slots_of(indices)
            slot_counts = torch.bincount(slots, minlength=world * s)
            if world == 1 and self._fused_pairs(x, slots):
                pending = self.comm.dispatch(x, slot_counts, name)  # the tokens, not per pair
                return Routed(None, weights, [x.shape[0]], pending, name, pair_slots=slots)
            order = torch.argsort(slots, stable=True)
        with rec.compute(f"{name}.pack"):
            # one rank sends everything to itself: no host round trip for the split
            send_splits = (
                [order.numel()] if world == 1 else slot_counts.view(world, s).sum(1).tolist()
            )
            rows = x.index_select(0, order // top_k)
        pending = self.comm.dispatch(rows, slot_counts, name)
        return Routed(order, weights, send_splits, pending, name)

    def _fused_pairs(self, x: torch.Tensor, pair_slots: torch.Tensor) -> bool:
        """Whether one rank's few routed pairs (at most :data:`KERNEL_EXPERT_ROWS`) run their
        experts and the gate-weighted sum as one CPU kernel (``expert_rows`` with ``combine``), in
        place of the sort, the per-pair copy of the tokens, the experts and the weighted sum
        (~150 us a layer for one token's 4 pairs of the small benchmark checkpoint, bfloat16)."""
        if not 0 < pair_slots.numel() <= KERNEL_EXPERT_ROWS:
            return False
        stacked = self._stacked_weights()
        return stacked is not None and _kernel_rows(x, stacked[0])

    def _slots_of(self, indices: torch.Tensor) -> torch.Tensor:
        """``[T * k]`` physical slot of every routed pair of ``indices [T, k]``."""
        if self._slot_table is None and int(self.plan.logcnt[self.layer].max()) == 1:
            # one replica per expert: a lookup, no spreading to compute (and no host round trip)
            table = torch.from_numpy(self.plan.log2phy[self.layer, :, 0].astype(np.int64))
            self._slot_table = table.to(indices.device)
        if self._slot_table is not None:
            return self._slot_table[indices.reshape(-1)]
        # Interleaved global token ids (local index * world + rank) need no exchange and differ
        # between ranks, so every rank starts each expert's replicas at a different one.
        token_ids = (
            torch.arange(indices.shape[0], dtype=torch.int64, device=indices.device)
            * self.comm.world_size
            + self._token_offset
        )
        return replica_for_tokens(self.plan, self.layer, indices, token_ids[:, None]).reshape(-1)

    def compute_experts(self, routed: Routed) -> torch.Tensor:
        """Wait for the dispatch, run the local experts on the received rows -> ``[N, H]``."""
        rows, recv_counts = routed.pending.wait()
        if routed.pair_slots is not None:  # see _fused_pairs
            routed.recv_splits = [rows.shape[0]]
            w13, w2 = self._stacked_weights()
            limit = self.config.swiglu_limit
            return torch.ops.moeinfra.expert_rows(
                rows, routed.pair_slots, w13, w2, limit, routed.weights
            )
        world, s = self.comm.world_size, self.slots_per_rank
        recv_counts = recv_counts.view(world, s)
        routed.recv_splits = [rows.shape[0]] if world == 1 else recv_counts.sum(1).tolist()
        counts = recv_counts.sum(0)
        if world == 1:  # rows arrive sorted by slot already
            by_slot = None
        else:
            recv_slot = torch.repeat_interleave(
                torch.arange(s, device=rows.device).repeat(world), recv_counts.reshape(-1)
            )
            by_slot = torch.argsort(recv_slot, stable=True)
        stacked = self._stacked_weights()
        if stacked is not None:
            w13, w2 = stacked
            limit = self.config.swiglu_limit
            sorted_rows = rows if by_slot is None else rows.index_select(0, by_slot)
            if _kernel_rows(sorted_rows, w13):
                slot_of_row = torch.repeat_interleave(counts)
                done = torch.ops.moeinfra.expert_rows(sorted_rows, slot_of_row, w13, w2, limit)
            elif _per_slot_gemms(sorted_rows, s):
                done = _slot_gemms(sorted_rows, counts, w13, w2, limit)
            elif _padded_batch_gemms(sorted_rows, counts, _slot_bytes(w13, w2)):
                done = _padded_expert_gemms(sorted_rows, counts, w13, w2, limit)
            elif _half_slot_gemms(sorted_rows, w13, w2):
                done = _slot_gemms(sorted_rows, counts, w13, w2, limit)
            else:
                ends = counts.cumsum(0).to(torch.int32)
                gate, up = F.grouped_mm(sorted_rows, w13.transpose(1, 2), offs=ends).chunk(2, -1)
                done = F.grouped_mm(swiglu(gate, up, limit), w2.transpose(1, 2), offs=ends)
            if by_slot is None:
                return done
            out = torch.empty_like(rows)
            out.index_copy_(0, by_slot, done)
            return out
        if by_slot is None:
            by_slot = torch.arange(rows.shape[0], device=rows.device)
        out = torch.empty_like(rows)
        start = 0
        for slot, count in enumerate(counts.tolist()):
            if count:
                idx = by_slot[start : start + count]
                out.index_copy_(0, idx, self.experts[slot](rows.index_select(0, idx)))
                start += count
        return out

    def _stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The slots' expert weights stacked for one grouped GEMM per projection, each slot's in
        the ``[out, in]`` layout of a linear weight: ``w13 [slots, 2I, H]`` (gate and up) and
        ``w2 [slots, H, I]``; rebuilt after a migration.
        None where ``grouped_mm`` cannot run them (its operands need 16-byte-aligned strides).
        The experts' own weights become views of the stacks, so the weights are held once."""
        if self._stack is None:
            first = self.experts[0]
            weight = first.w1.weight
            if not isinstance(first.w1, nn.Linear):
                return None  # weights kept in another format (FP8) run expert by expert
            item = weight.element_size()
            dims = (first.w1.in_features, first.w1.out_features)
            if not hasattr(F, "grouped_mm") or any(d * item % 16 for d in dims):
                return None
            if weight.device.type == "cuda" and weight.dtype != torch.bfloat16:
                return None  # CUDA's grouped GEMM takes bfloat16 operands only
            with torch.no_grad():
                w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in self.experts])
                w2 = torch.stack([e.w2.weight for e in self.experts])
                inter = first.w1.out_features
                for slot, e in enumerate(self.experts):
                    e.w1.weight.data = w13[slot, :inter]
                    e.w3.weight.data = w13[slot, inter:]
                    e.w2.weight.data = w2[slot]
            self._stack = (w13, w2)
        return self._stack

    def combine(self, routed: Routed, expert_out: torch.Tensor, name: str = "combine") -> Pending:
        """Issue the combine: send expert outputs back to the tokens' ranks (async)."""
        return self.comm.all_to_all(expert_out, routed.recv_splits, routed.send_splits, name)

    def finish_combine(self, routed: Routed, pending: Pending) -> torch.Tensor:
        """Wait for the combine and sum each token's copies with its gate weights -> ``[T, H]``."""
        back, _ = pending.wait()
        if routed.pair_slots is not None:  # summed already
            return back
        num_tokens, top_k = routed.weights.shape
        # each pair's row of ``back`` (sorted by slot): a gather, ~8x as fast as scattering
        # ``back`` to ``pairs[order]`` on the CPU
        where = torch.empty_like(routed.order)
        where.scatter_(0, routed.order, torch.arange(where.numel(), device=where.device))
        pairs = back.index_select(0, where)
        return combine_pairs(pairs.view(num_tokens, top_k, back.shape[-1]), routed.weights)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x) if self.shared is not None else torch.zeros_like(x)

    def routed_output(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor):
        routed = self.dispatch(x, weights, indices)
        return self.finish_combine(routed, self.combine(routed, self.compute_experts(routed)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` (this rank's tokens, T may be 0) -> routed + shared output ``[T, H]``."""
        weights, indices = self.gate(x)
        return self.routed_output(x, weights, indices) + self.shared_output(x)

    # ------------------------------------------------------------------ load and placement
    def take_load(self, all_reduce: bool = True) -> torch.Tensor:
        """``[E]`` int64 routed copies per logical expert since the last call (summed over ranks
        when ``all_reduce``); resets the counter."""
        counts = self.load_counts.clone()
        self.load_counts.zero_()
        if all_reduce and self.comm.distributed and self.comm.world_size > 1:
            counts = counts.to(self.gate.weight.device)  # NCCL reduces device tensors only
            dist.all_reduce(counts, group=self.comm.group)
        return counts.cpu()

    def apply_plan(self, new_plan: Plan) -> int:
        """Move to ``new_plan``: slots whose expert changes get its weights, from a local copy when
        this rank already held the expert, else by p2p from the rank
        :func:`moeinfra.eplb.migration` names. Collective (every rank calls it). Returns the number of
        expert weight tensors this rank received."""
        if new_plan.layout != self.plan.layout:
            raise InputError(f"new_plan layout {new_plan.layout} differs from {self.plan.layout}")
        rank = self.comm.rank
        old_local = self.local_experts()
        transfers = migration(self.plan, new_plan).transfers
        transfers = transfers[transfers[:, 0] == self.layer]
        ops, received = [], {}
        size = _flat_expert(self.experts[0]).numel()
        dtype = torch.uint8
        device = next(self.experts[0].parameters()).device
        to_global = (
            (lambda r: dist.get_global_rank(self.comm.group, r))
            if self.comm.group is not None
            else (lambda r: r)
        )
        for _, expert, src, dst in transfers.tolist():
            if src == rank:
                ops.append(
                    dist.P2POp(
                        dist.isend,
                        _flat_expert(self.experts[old_local.index(expert)]).contiguous(),
                        to_global(dst),
                        group=self.comm.group,
                        tag=expert,
                    )
                )
            if dst == rank:
                received[expert] = torch.empty(size, dtype=dtype, device=device)
                ops.append(
                    dist.P2POp(
                        dist.irecv,
                        received[expert],
                        to_global(src),
                        group=self.comm.group,
                        tag=expert,
                    )
                )
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        s = self.slots_per_rank
        new_local = [int(e) for e in new_plan.phy2log[self.layer, rank * s : (rank + 1) * s]]
        experts = []
        for expert in new_local:
            if expert in old_local:
                experts.append(self.experts[old_local.index(expert)])
            else:
                module = copy.deepcopy(self.experts[0])
                _load_flat(module, received[expert])
                experts.append(module)
        self.experts = nn.ModuleList(_distinct(experts))
        self._stack = self._slot_table = None
        self.plan = new_plan
        return len(received)


# Rows per expert slot from which a float32 CPU batch runs one oneDNN GEMM per slot instead of
# torch's grouped GEMM (MKL per group): 4.9 vs 10.3 ms for 4,096 rows over 32 slots, 2 threads.
PER_SLOT_GEMM_ROWS = 64


# Routed rows per local slot (on average) up to which a step's experts run as moeinfra's CPU
# kernel (``expert_rows``: each run of one slot's rows reads that slot's weights once, in place, no
# copies, in 4 x 4 tiles). Float32, and half precision on a CPU without oneDNN's: 32 — the tiles
# beat the padded batch and the per-slot GEMMs there: 512 rows over 64 slots of hidden 1,024,
# 512-wide experts, 24 vs 35 and 64 ms; 2,048 rows 79 vs 115 and 98 ms; 32 slots of hidden 256 from
# 4,096 rows on (64 a slot) the per-slot GEMMs win, 13 vs 22 ms. Half precision where oneDNN has
# it: 8 (at least KERNEL_EXPERT_ROWS rows) — oneDNN's bfloat16 GEMMs catch up sooner: 512 rows over
# 64 slots 22 vs 25 ms, 512 over 32 slots of hidden 256 1.4 vs 1.3 ms; a bfloat16 batch of 16
# requests of the wide benchmark checkpoint 96 -> 118 tokens/s. 2 threads, AVX-512.
KERNEL_ROWS_PER_SLOT = 32
KERNEL_HALF_ROWS_PER_SLOT = 8
KERNEL_EXPERT_ROWS = 32


def _kernel_rows(rows: torch.Tensor, w13: torch.Tensor) -> bool:
    n = rows.shape[0]
    if not (n > 0 and rows.dtype == w13.dtype and cpu_kernels.usable(rows, w13)):
        return False
    slots = w13.shape[0]
    if rows.dtype == torch.float32 or not cpu_features.onednn_packs(rows.dtype):
        return n <= KERNEL_ROWS_PER_SLOT * slots
    return n <= max(KERNEL_EXPERT_ROWS, KERNEL_HALF_ROWS_PER_SLOT * slots)


def _per_slot_gemms(rows: torch.Tensor, slots: int) -> bool:
    return (
        rows.device.type == "cpu"
        and rows.dtype == torch.float32
        and rows.shape[0] >= PER_SLOT_GEMM_ROWS * slots
    )


def _half_slot_gemms(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Half-precision CPU rows past the padded batch run :func:`_slot_gemms` unless autograd
    needs them (its GEMMs write into one output; torch's grouped GEMM differentiates)."""
    return (
        rows.device.type == "cpu"
        and rows.dtype != torch.float32
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (rows, w13, w2)))
    )


# oneDNN (torch's half-precision CPU GEMMs, and :func:`linear`'s float32 ones) builds a kernel for
# every new shape, ~0.2-0.5 ms each, and keeps the last 1,024; a slot's row count is a new shape
# nearly every prefill step. Rounded up to a multiple of this, up to 2,048 rows per slot are 143
# shapes per projection (128 multiples, 15 rests under 16; see _slot_spans):
# 32 slots' GEMMs over 16,384 bfloat16 rows with new counts every call 8.6-18 -> 6.6-10 ms (the
# same counts again: 6.7 ms both; hidden 256, 128-wide experts, 2 threads).
EXPERT_ROWS_BUCKET = 16


def _slot_spans(counts: torch.Tensor, total: int) -> list[tuple[int, int, int]]:
    """``(slot, first row, rows)`` of each GEMM over rows sorted by slot with ``counts`` rows each:
    a slot's count rounded up to :data:`EXPERT_ROWS_BUCKET` reads on into the next slots' rows
    (their GEMMs run later and write their own results over those). Where that would pass the
    last row, the slot runs as a multiple of the bucket and the rest (under 16 rows)."""
    bucket = EXPERT_ROWS_BUCKET
    spans = []
    start = 0
    for slot, count in enumerate(counts.tolist()):
        if count:
            rounded = -(-count // bucket) * bucket
            if start + rounded <= total:
                spans.append((slot, start, rounded))
            else:
                whole = count - count % bucket
                if whole:
                    spans.append((slot, start, whole))
                spans.append((slot, start + whole, count - whole))
            start += count
    return spans


def _slot_gemms(rows, counts, w13, w2, limit) -> torch.Tensor:
    """The experts of rows sorted by slot, one GEMM per slot and projection over its rows as
    :func:`_slot_spans` rounds them (results equal to one GEMM over its rows alone: each row's
    product is its own). Float32 through :func:`linear` (torch's float32 ``mm`` is MKL's)."""
    spans = _slot_spans(counts, rows.shape[0])
    done = torch.empty_like(rows)
    if rows.dtype == torch.float32:
        for slot, start, n in spans:
            gate, up = linear(rows[start : start + n], w13[slot]).chunk(2, dim=-1)
            done[start : start + n] = linear(swiglu(gate, up, limit), w2[slot])
        return done
    mid = rows.new_empty(rows.shape[0], w13.shape[1])
    for slot, start, n in spans:
        torch.mm(rows[start : start + n], w13[slot].t(), out=mid[start : start + n])
    gate, up = mid.chunk(2, dim=-1)
    act = swiglu(gate, up, limit)
    for slot, start, n in spans:
        torch.mm(act[start : start + n], w2[slot].t(), out=done[start : start + n])
    return done


PADDED_EXPERT_BYTES = 4 << 20
# Expert weights a padded or per-row batch copies at most (its used slots', or its rows' slots'):
# the copy pays while it is cache-sized and the experts small (a 32-expert layer of hidden 256);
# one expert of hidden 2,048 and 1,024-wide experts is 12 MB in bfloat16, and 8 rows over 8 such
# slots took ~48 ms copied against ~6.5 ms on torch's grouped GEMM (one thread).
GATHERED_EXPERT_BYTES = 8 << 20


def _slot_bytes(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Bytes of one slot's expert weights."""
    return (w13[0].numel() + w2[0].numel()) * w13.element_size()


def _per_row_experts(rows: torch.Tensor, slot_bytes: int) -> bool:
    """Whether ``rows`` run one batch entry each (:data:`PER_ROW_EXPERT_ROWS`)."""
    num_rows = rows.shape[0]
    return num_rows <= PER_ROW_EXPERT_ROWS and num_rows * slot_bytes <= GATHERED_EXPERT_BYTES


def _padded_batch_gemms(rows: torch.Tensor, counts: torch.Tensor, slot_bytes: int) -> bool:
    """On the CPU torch's grouped GEMM runs one call per group (bfloat16: one oneDNN call, ~13 us
    however few rows; float32: a loop over every group, used or not), slower than one batched GEMM
    over the used slots with their rows padded to the fullest one's: 0.33 vs 0.54 ms for 32 rows
    over 32 slots, 0.40 vs 0.81 ms for 128 (gate and up projection, bfloat16, one thread, caches
    cold); a float32 decode step of 8 requests of the 32-expert benchmark checkpoint ~10.3 vs
    ~10.8 ms, of 32 requests ~18.6 vs ~19.2 (2 threads). Not once the padded rows reach
    :data:`PADDED_EXPERT_BYTES` (a prefill step): zeros written and multiplied for nothing, out
    of the cache — 13.8 vs 4.0 ms for 8,192 rows over 32 slots of hidden 256, 14.6 vs 8.1 ms for
    1,024 rows of hidden 1,024 (bfloat16, 2 threads) — nor once the slots' weights it would
    copy (``slot_bytes`` each) pass :data:`GATHERED_EXPERT_BYTES`. Always for rows that run one
    batch entry each (:func:`_per_row_experts`)."""
    if rows.device.type != "cpu":
        return False
    if _per_row_experts(rows, slot_bytes):  # no rows included
        return True
    gathered, batch, width = _padded_shape(counts)
    if gathered is not None and batch * slot_bytes > GATHERED_EXPERT_BYTES:
        return False
    return batch * width * rows.shape[1] * rows.element_size() < PADDED_EXPERT_BYTES


def _padded_shape(counts: torch.Tensor) -> tuple[torch.Tensor | None, int, int]:
    """``(gathered, batch, width)`` of the padded expert GEMMs of slots with ``counts`` rows
    (some): the slots whose weights are gathered (None: every slot's, in order, once more than
    half have rows — copying a slot's weights costs about what its GEMM does: 3 MB of them for 24
    of 32 slots of hidden 256 took 0.35 ms, their GEMMs 0.32 ms), how many slots the batch holds
    and how many rows each is padded to (the fullest one's, rounded up to a power of two).
    Shapes are rounded up — more slots, of no rows, and more padding rows — because oneDNN builds
    a kernel for every new shape (~0.4 ms) and the used slots and the fullest one's rows vary by
    step; up to :data:`_SLOT_BUCKET` slots are kept as they are (few shapes, none gathered for
    nothing)."""
    used = counts.nonzero().flatten()
    width = 1 << (int(counts.max()) - 1).bit_length()
    if 2 * used.numel() > counts.numel():
        return None, counts.numel(), width
    batch = used.numel()
    if batch > _SLOT_BUCKET:
        batch = min(-(-batch // _SLOT_BUCKET) * _SLOT_BUCKET, counts.numel())
    if batch > used.numel():  # slots without rows fill the batch: their output is unread
        used = torch.cat([used, (counts == 0).nonzero().flatten()[: batch - used.numel()]])
    return used, batch, width


_SLOT_BUCKET = 8

# Rows up to which the padded expert GEMMs run one row per batch entry, each with its own slot's
# weights gathered (within GATHERED_EXPERT_BYTES), instead of the padded layout's bookkeeping (two
# repeat_interleaves against one, the zeroed batch, two row moves): 72 vs 106 us for 4 rows, 156 vs
# 197 us for 16 (14 slots), 257 vs 191 us for 32 (19 slots); hidden 256, bfloat16, 2 threads. In
# float32 a one-request decode step of the benchmark checkpoint ~6.5 ms against ~7 with torch's
# grouped GEMM.
PER_ROW_EXPERT_ROWS = 16


def _padded_expert_gemms(rows, counts, w13, w2, limit) -> torch.Tensor:
    """The experts of ``rows [N, H]`` (sorted by slot, ``counts [slots]`` each) as two batched
    GEMMs over the slots of :func:`_padded_shape`, each slot's rows padded with zeros (a zero row
    stays zero through SwiGLU) -> ``[N, H]``; over the rows themselves, each with its slot's
    weights, where :func:`_per_row_experts`."""
    if rows.shape[0] == 0:  # a rank no token of the step was routed to
        return torch.empty_like(rows)
    if _per_row_experts(rows, _slot_bytes(w13, w2)):  # each row its slot's weights: no padding
        slots = torch.repeat_interleave(counts)
        w13, w2 = w13.index_select(0, slots), w2.index_select(0, slots)
        gate, up = torch.bmm(rows[:, None], w13.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(swiglu(gate, up, limit), w2.transpose(1, 2))[:, 0]
    gathered, batch, width = _padded_shape(counts)
    per_slot = counts if gathered is None else counts[gathered]
    slot = torch.repeat_interleave(torch.arange(per_slot.numel(), device=rows.device), per_slot)
    first = torch.repeat_interleave(per_slot.cumsum(0) - per_slot, per_slot)
    place = torch.arange(rows.shape[0], device=rows.device) - first
    at = slot * width + place  # each row's place in the padded batch, flattened
    padded = rows.new_zeros(batch * width, rows.shape[1]).index_copy_(0, at, rows)
    padded = padded.view(batch, width, rows.shape[1])
    if gathered is not None:
        w13, w2 = w13.index_select(0, gathered), w2.index_select(0, gathered)
    gate, up = torch.bmm(padded, w13.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(swiglu(gate, up, limit), w2.transpose(1, 2))
    return out.view(batch * width, -1).index_select(0, at)


def _distinct(modules: list[Expert]) -> list[Expert]:
    """A slot may repeat an expert the rank already holds: distinct modules, same weights."""
    seen: set[int] = set()
    out = []
    for module in modules:
        out.append(copy.deepcopy(module) if id(module) in seen else module)
        seen.add(id(module))
    return out


def rank_experts(plan: Plan, layer: int, rank: int) -> list[int]:
    """Logical experts of ``rank``'s slots in ``layer`` (what a loader must read for it)."""
    slots = plan.layout.num_replicas // plan.layout.num_gpus
    return sorted({int(e) for e in plan.phy2log[layer, rank * slots : (rank + 1) * slots]})


def load_matrix(layers: list[ExpertParallelMoE], all_reduce: bool = True) -> np.ndarray:
    """``[L, E]`` int64 load of every layer since the last call (for ``eplb.LoadEstimator.record``)."""
    return np.stack([layer.take_load(all_reduce).numpy() for layer in layers])


def take_step_loads(layers: list[ExpertParallelMoE]) -> torch.Tensor:
    """``[L, E]`` int64 routed copies every layer counted since the last call, on the layers'
    device (no host round trip: an engine keeps one per step); resets the counters."""
    load = torch.stack([layer.load_counts for layer in layers])
    for layer in layers:
        layer.load_counts.zero_()
    return load
