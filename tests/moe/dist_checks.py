"""Multi-process checks of the expert-parallel MoE, run by test_distributed.py on spawned gloo ranks.

Every rank builds the same model from a fixed seed and makes every rank's tokens, so each rank computes
the single-process reference itself. :func:`run_all` runs every check on one rank and returns
``{check: None or failure message}``, so one process group serves all checks.
"""

from __future__ import annotations

import traceback

import numpy as np
import torch
import torch.distributed as dist

from moeinfra.eplb import migration, rebalance
from moeinfra.eplb.inputs import check_layout
from moeinfra.eplb.plan import make_plan
from moeinfra.errors import InputError
from moeinfra.moe.block import build_decoder
from moeinfra.moe.comm import Communicator
from moeinfra.moe.config import tiny
from moeinfra.moe.expert_parallel import ExpertParallelMoE
from moeinfra.moe.layers import build_moe
from moeinfra.moe.run import segments_for
from moeinfra.moe.runtime import ExpertParallelDecoder
from moeinfra.moe.timeline import Recorder

TOL = 1e-5


def _tokens(rank: int, n: int, hidden: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed * 100 + rank))


def _plan(load: np.ndarray, redundant: int, groups: int):
    world = dist.get_world_size()
    return rebalance(load, load.shape[1] + redundant, groups, 1, world)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max()) if out.numel() else 0.0


def check_equal_reference(redundant: int, token_counts: list[int], config=None) -> str | None:
    config = config or tiny()
    rank = dist.get_rank()
    moe = build_moe(config, seed=1)
    load = np.random.default_rng(3).random((1, config.num_routed_experts)) * 100
    plan = _plan(load, redundant, config.num_expert_groups)
    ep = ExpertParallelMoE(moe, plan, 0, Communicator())
    x = _tokens(rank, token_counts[rank % len(token_counts)], config.hidden_size)
    with torch.no_grad():
        err = _err(ep(x), moe(x))
    return None if err <= TOL else f"max abs error {err:.3g} (redundant={redundant})"


def check_one_expert() -> str | None:
    """Every token routed to one expert (top-1, huge bias on expert 5)."""
    config = tiny().replace(experts_per_token=1, groups_per_token=1)
    rank = dist.get_rank()
    moe = build_moe(config, seed=2)
    moe.gate.bias[5] = 100.0
    plan = _plan(np.ones((1, config.num_routed_experts)), 2 * dist.get_world_size(), 4)
    ep = ExpertParallelMoE(moe, plan, 0, Communicator())
    ep.record_load = True
    x = _tokens(rank, 40, config.hidden_size)
    with torch.no_grad():
        err = _err(ep(x), moe(x))
    load = ep.take_load(all_reduce=True)
    if int(load[5]) != 40 * dist.get_world_size() or int(load.sum()) != int(load[5]):
        return f"load {load.tolist()} is not all on expert 5"
    return None if err <= TOL else f"max abs error {err:.3g}"


def check_hot_expert_spread() -> str | None:
    """Every rank's 7 tokens go to expert 5 only, which has a replica on every rank and a second
    one on the rank holding it (16 experts, 16 / world + 1 slots per rank). Worked from
    replica_for_tokens' rule: rank r numbers its tokens t * world + r, so its k-th pair goes to
    replica (k + r) mod replicas; each rank receives, from each sender, exactly those counts."""
    config = tiny()
    rank, world = dist.get_rank(), dist.get_world_size()
    experts, tokens = config.num_routed_experts, 7
    per_rank = experts // world
    phy2log = np.array(
        [[e for r in range(world) for e in [*range(r * per_rank, (r + 1) * per_rank), 5]]]
    )
    layout = check_layout(experts, phy2log.shape[1], config.num_expert_groups, 1, world)
    plan = make_plan(phy2log, np.ones((1, experts)), layout, "hand")
    ep = ExpertParallelMoE(build_moe(config, seed=6), plan, 0, Communicator())
    replica_slots = np.flatnonzero(phy2log[0] == 5)  # replica j is the j-th slot holding 5
    expected = np.zeros((world, per_rank + 1), dtype=np.int64)  # [sender, this rank's slot]
    for sender in range(world):
        for k in range(tokens):
            slot = replica_slots[(k + sender) % replica_slots.size]
            if slot // (per_rank + 1) == rank:
                expected[sender, slot % (per_rank + 1)] += 1
    x = _tokens(rank, tokens, config.hidden_size)
    indices = torch.full((tokens, 1), 5, dtype=torch.int64)
    routed = ep.dispatch(x, torch.ones(tokens, 1), indices)
    _, recv_counts = routed.pending.wait()
    got = recv_counts.view(world, per_rank + 1).numpy()
    if not np.array_equal(got, expected):
        return f"received per (sender, slot) {got.tolist()}, expected {expected.tolist()}"
    return None


def check_load_and_migration(group=None) -> str | None:
    """Load counting, its all-reduce and the weight migration, on ``group``'s ranks only."""
    config = tiny()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    moe = build_moe(config, seed=4)
    with torch.no_grad():
        moe.gate.bias.copy_(torch.linspace(-0.4, 0.4, config.num_routed_experts))
    ones = np.ones((1, config.num_routed_experts))
    plan0 = rebalance(ones, config.num_routed_experts + world, config.num_expert_groups, 1, world)
    ep = ExpertParallelMoE(moe, plan0, 0, Communicator(group))
    ep.record_load = True
    xs = [_tokens(r, 30 + 7 * r, config.hidden_size, seed=5) for r in range(world)]
    with torch.no_grad():
        out = ep(xs[rank])
        expected = sum(moe.expert_counts(x) for x in xs)
    local = ep.load_counts.clone()
    load = ep.take_load(all_reduce=True)
    if not torch.equal(load, expected):
        return f"all-reduced load {load.tolist()} != {expected.tolist()}"
    if not torch.equal(local, moe.expert_counts(xs[rank])):
        return "local load differs from the reference counts"
    if ep.load_counts.sum() != 0:
        return "take_load did not reset the counter"
    plan1 = rebalance(
        load.numpy()[None].astype(float),
        config.num_routed_experts + world,
        config.num_expert_groups,
        1,
        world,
    )
    moves = migration(plan0, plan1).transfers
    received = ep.apply_plan(plan1)
    expected_received = int((moves[:, 3] == rank).sum())
    if received != expected_received:
        return f"received {received} experts, migration lists {expected_received}"
    if ep.local_experts() != [int(e) for e in plan1.phy2log[0].reshape(world, -1)[rank]]:
        return "local experts do not follow the new plan"
    with torch.no_grad():
        err = max(_err(out, moe(xs[rank])), _err(ep(xs[rank]), moe(xs[rank])))
    if world > 1 and rank == 0 and len(moves) == 0:
        return "test plan change moved nothing"
    return None if err <= TOL else f"error after migration {err:.3g}"


def check_in_subgroups() -> str | None:
    """The same on process groups other than the default one: every rank alone (its load is its
    own), and halves of 4 ranks or both ranks of 2 in a new group (each sums and migrates inside
    its group)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    for size in (1, world // 2 if world >= 4 else world):
        groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
        failure = check_load_and_migration(groups[rank // size])
        if failure:
            return f"groups of {size}: {failure}"
    return None


def check_one_slot_per_rank() -> str | None:
    """As many experts as ranks, one slot each; the new plan moves every expert one rank on."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return None
    config = tiny().replace(
        num_routed_experts=world, num_expert_groups=1, groups_per_token=1, experts_per_token=1
    )
    moe = build_moe(config, seed=8)
    layout = check_layout(world, world, 1, 1, world)
    ones = np.ones((1, world))
    plan0 = make_plan(np.arange(world)[None], ones, layout, "hand")
    plan1 = make_plan(np.roll(np.arange(world), 1)[None], ones, layout, "hand")
    ep = ExpertParallelMoE(moe, plan0, 0, Communicator())
    if ep.apply_plan(plan1) != 1 or ep.local_experts() != [(rank - 1) % world]:
        return f"rank {rank} holds {ep.local_experts()} after the move"
    x = _tokens(rank, 20, config.hidden_size, seed=9)
    with torch.no_grad():
        err = _err(ep(x), moe(x))
    return None if err <= TOL else f"error after the move {err:.3g}"


def check_overlap_modes() -> str | None:
    config = tiny()
    rank, world = dist.get_rank(), dist.get_world_size()
    decoder = build_decoder(config, seed=6)
    plan = _plan(np.ones((config.num_layers, config.num_routed_experts)), world, 4)
    recorder = Recorder(rank=rank)
    model = ExpertParallelDecoder(decoder, plan, Communicator(delay_s=0.001, recorder=recorder))
    n = [96, 50, 0, 77][rank % 4]  # rank 2 has no tokens
    x = _tokens(rank, n, config.hidden_size, seed=7)
    segments = segments_for(n, 40)
    ref = decoder(x, segments).detach() if n else x
    outs = {}
    for mode in ("none", "prefill", "decode"):
        recorder.clear()
        outs[mode] = model(x, segments, mode)
        err = _err(outs[mode], ref)
        if err > TOL:
            return f"{mode}: error vs reference {err:.3g}"
        tracks = {e[1] for e in recorder.events}
        if tracks != {0, 1}:
            return f"{mode}: timeline tracks {tracks}"
        names = " ".join(e[0] for e in recorder.events)
        if mode != "none" and ("mb1" not in names or "COMBINE" not in names):
            return f"{mode}: timeline misses micro-batch 1 or combine events"
        if n and "OUT(mb0).sum" not in names:  # the last layer's combined rows summed, on its own
            return f"{mode}: timeline misses the combine's sum"
        if mode == "prefill":  # DISPATCH(mb1) is issued before ATTN(mb0) and waited after it
            start = {e[0]: e[2] for e in recorder.events}
            end = {e[0]: e[3] for e in recorder.events}
            if not start["DISPATCH(mb1) L0"] <= start["ATTN(mb0) L0"] <= end["ATTN(mb0) L0"]:
                return "prefill: DISPATCH(mb1) was not in flight during ATTN(mb0)"
            if start["MLP(mb1) L0"] < end["ATTN(mb0) L0"]:
                return "prefill: MLP(mb1) ran before ATTN(mb0)"
    for mode in ("prefill", "decode"):
        if _err(outs[mode], outs["none"]) > TOL:
            return f"{mode} differs from no overlap"
    return None


def check_bad_plan() -> str | None:
    config = tiny()
    world = dist.get_world_size()
    plan = rebalance(np.ones((1, 16)), 16 * (world + 1), 4, 1, world + 1)
    try:
        ExpertParallelMoE(build_moe(config), plan, 0, Communicator())
    except InputError as exc:
        if "world_size" not in str(exc):
            return f"unclear message: {exc}"
        return None
    return "plan for another world size accepted"


CHECKS = {
    "equal_no_redundant": lambda: check_equal_reference(0, [33, 20, 41, 9]),
    "equal_redundant": lambda: check_equal_reference(2 * dist.get_world_size(), [25, 64, 3, 50]),
    "empty_rank": lambda: check_equal_reference(dist.get_world_size(), [0, 31, 0, 12]),
    "all_ranks_empty": lambda: check_equal_reference(0, [0]),
    "one_expert": check_one_expert,
    "load_and_migration": check_load_and_migration,
    "subgroups": check_in_subgroups,
    "one_slot_per_rank": check_one_slot_per_rank,
    "hot_expert_spread": check_hot_expert_spread,
    "overlap_modes": check_overlap_modes,
    "bad_plan": check_bad_plan,
}


def run_all(names: list[str]) -> dict[str, str | None]:
    results = {}
    for name in names:
        try:
            results[name] = CHECKS[name]()
        except Exception:  # report, then keep the ranks in step
            results[name] = traceback.format_exc(limit=5)
        dist.barrier()
    return results


def fail_on_rank_one() -> None:
    """Rank 1 fails while rank 0 waits in a collective: the launcher must not hang."""
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()
