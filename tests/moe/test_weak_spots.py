"""The micro-batch split's tie-breaks, worked by hand from ``split_micro_batches``' docstring
(issue #18): equal lengths keep their order, an equal attention cost sends a sequence to micro-batch
1, a cut between two sequence boundaries equally far from the middle takes the later one, and an odd
token count gives micro-batch 1 the extra token."""

import pytest

torch = pytest.importorskip("torch")

from moeinfra.moe.mla import Segment  # noqa: E402
from moeinfra.moe.runtime import attention_cost, split_micro_batches  # noqa: E402


def _rows(split):
    return [split.rows[m].tolist() for m in (0, 1)]


def test_equal_sequences_alternate_starting_with_micro_batch_one():
    # Four sequences of 3 tokens from position 0, rows 0-2, 3-5, 6-8, 9-11; each costs 6.
    # Longest first with ties in order: s0 -> mb1 (costs tie 0/0), s1 -> mb0 (6 > 0),
    # s2 -> mb1 (6/6 tie), s3 -> mb0. Stream mb1 then mb0: s0 s2 | s1 s3; cut at 6 tokens.
    segments = [Segment(i, 0, 3) for i in range(4)]
    assert attention_cost(0, 3) == 6
    split = split_micro_batches(segments)
    assert [[s.seq for s in split.segments[m]] for m in (0, 1)] == [[1, 3], [0, 2]]
    assert _rows(split) == [[3, 4, 5, 9, 10, 11], [0, 1, 2, 6, 7, 8]]
    assert split.attention_costs() == (12, 12)


def test_a_cut_equally_far_from_two_boundaries_takes_the_later_one():
    # Decode: three one-token sequences at position 10 (cost 11 each). Sides: s0 -> mb1, s1 -> mb0,
    # s2 -> mb1 (11 <= 11). Stream s0 s2 s1, boundaries 0 1 2 3 around a middle of 1.5:
    # 1 and 2 are equally far; the later one (2) is taken, so mb1 holds two sequences.
    segments = [Segment(i, 10, 1) for i in range(3)]
    split = split_micro_batches(segments, allow_split=False)
    assert [[s.seq for s in split.segments[m]] for m in (0, 1)] == [[1], [0, 2]]
    assert _rows(split) == [[1], [0, 2]]
    assert split.tokens() == (1, 2)


def test_an_odd_prefill_gives_micro_batch_one_the_extra_token_and_the_prefix():
    # One 7-token sequence from position 5 (rows 0-6): cut at (7 + 1) // 2 = 4 tokens.
    split = split_micro_batches([Segment(0, 5, 7)])
    assert split.segments[1] == [Segment(0, 5, 4)]
    assert split.segments[0] == [Segment(0, 9, 3)]
    assert _rows(split) == [[4, 5, 6], [0, 1, 2, 3]]
    assert (
        split.attention_costs() == (attention_cost(9, 3), attention_cost(5, 4)) == (33, 30)
    )  # keys 10+11+12 and 6+7+8+9


def test_a_longer_sequence_goes_first_whatever_its_place():
    # Lengths 2, 5, 2 (rows 0-1, 2-6, 7-8), all from 0: s1 (cost 15) -> mb1, then s0 (cost 3)
    # -> mb0 (15 > 0), s2 -> mb0 (15 > 3). Stream s1 | s0 s2, 9 tokens, cut at 5: exactly s1.
    segments = [Segment(0, 0, 2), Segment(1, 0, 5), Segment(2, 0, 2)]
    split = split_micro_batches(segments)
    assert [[s.seq for s in split.segments[m]] for m in (0, 1)] == [[0, 2], [1]]
    assert _rows(split) == [[0, 1, 7, 8], [2, 3, 4, 5, 6]]


def test_one_rank_spreads_a_hot_expert_over_its_replicas_counts_load_and_follows_a_new_plan():
    import numpy as np

    from moeinfra.eplb.inputs import check_layout
    from moeinfra.eplb.plan import make_plan
    from moeinfra.moe.config import tiny
    from moeinfra.moe.expert_parallel import ExpertParallelMoE
    from moeinfra.moe.layers import build_moe

    config = tiny().replace(experts_per_token=1, groups_per_token=1)
    moe = build_moe(config, seed=2)
    with torch.no_grad():
        moe.gate.bias[5] = 100.0  # every token's one expert is 5
    layout = check_layout(16, 20, 4, 1, 1)
    plan = make_plan(np.array([[*range(16), 5, 5, 9, 5]]), np.ones((1, 16)), layout, "hand")
    ep = ExpertParallelMoE(moe, plan, 0)
    ep.record_load = True
    x = torch.randn(10, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weights, indices = moe.gate(x)
        assert (indices == 5).all()
        # expert 5's replicas are slots 5, 16, 17, 19; token k goes to replica k mod 4: 3, 3, 2, 2
        _, counts = ep.dispatch(x, weights, indices).pending.wait()
        expected = torch.zeros(20, dtype=torch.int64)
        expected[[5, 16, 17, 19]] = torch.tensor([3, 3, 2, 2])
        assert torch.equal(counts, expected)
        assert torch.allclose(ep(x), moe(x), atol=1e-5)
    load = ep.take_load()
    assert load[5] == 20 and load.sum() == 20  # the dispatch above and the forward
    assert ep.load_counts.sum() == 0
    # one rank holds every expert: a new plan is all local copies, nothing received
    moved = make_plan(np.array([[*range(16), 0, 1, 2, 3]]), np.ones((1, 16)), layout, "hand")
    assert ep.apply_plan(moved) == 0
    assert ep.local_experts() == [*range(16), 0, 1, 2, 3]
    with torch.no_grad():
        assert torch.allclose(ep(x), moe(x), atol=1e-5)


def test_experts_too_narrow_for_grouped_gemm_run_one_by_one_with_the_same_result():
    """grouped_mm needs 16-byte-aligned strides: 30-wide float32 experts (120 bytes) take the
    per-slot loop instead, and give the reference's output."""
    import numpy as np

    from moeinfra.eplb import rebalance
    from moeinfra.moe.config import tiny
    from moeinfra.moe.expert_parallel import ExpertParallelMoE
    from moeinfra.moe.layers import build_moe

    config = tiny().replace(moe_intermediate_size=30)
    moe = build_moe(config, seed=3)
    plan = rebalance(np.random.default_rng(2).random((1, 16)) * 100, 20, 4, 1, 1)
    ep = ExpertParallelMoE(moe, plan, 0)
    assert ep._stacked_weights() is None
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ep(x), moe(x), atol=1e-5)


def test_a_layer_from_the_ranks_own_experts_equals_the_reference_and_copies_repeated_slots():
    """ExpertParallelMoE.from_experts (what a checkpoint loader builds, rank_experts saying which
    experts to read) gives the reference's output; a slot repeating an expert gets its own copy.
    Also: the rank's layer keeps its own shared expert, and load counts are int64."""
    import numpy as np

    from moeinfra.eplb.inputs import check_layout
    from moeinfra.eplb.plan import make_plan
    from moeinfra.moe.config import tiny
    from moeinfra.moe.expert_parallel import ExpertParallelMoE, rank_experts
    from moeinfra.moe.layers import build_moe
    from moeinfra.moe.runtime import ExpertParallelDecoder

    config = tiny()
    moe = build_moe(config, seed=3)
    # 2 GPUs x 10 slots; rank 1's slots hold experts 8-15 and repeat 9 and 12
    layout = check_layout(16, 20, 4, 1, 2)
    row = [*range(8), 0, 1, *range(8, 16), 9, 12]
    plan = make_plan(np.array([row]), np.ones((1, 16)), layout, "hand")
    assert rank_experts(plan, 0, 1) == list(range(8, 16))
    assert rank_experts(plan, 0, 0) == list(range(8))
    everything = make_plan(
        np.array([[*range(16), 9, 9, 12, 0]]),
        np.ones((1, 16)),
        check_layout(16, 20, 4, 1, 1),
        "hand",
    )
    parts = {e: moe.experts[e] for e in rank_experts(everything, 0, 0)}
    ep = ExpertParallelMoE.from_experts(config, moe.gate, moe.shared, parts, everything)
    assert len({id(m) for m in ep.experts}) == 20  # 9 twice more and 12 once more: copies
    assert ep.experts[0] is moe.experts[0]  # a first slot uses the loader's module as it is
    x = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ep(x), moe(x), atol=1e-5)
    with pytest.raises(Exception, match=r"must hold this rank's experts \[3\]"):
        ExpertParallelMoE.from_experts(
            config, moe.gate, moe.shared, {e: m for e, m in parts.items() if e != 3}, everything
        )
    copied = ExpertParallelMoE(moe, everything)
    assert all(
        p is not q for p, q in zip(copied.shared.parameters(), moe.shared.parameters(), strict=True)
    )
    copied.record_load = True
    with torch.no_grad():
        copied(x)
    assert copied.take_load().dtype == torch.int64
    decoder = ExpertParallelDecoder.from_layers(
        torch.nn.ModuleList([torch.nn.Identity()]), torch.nn.ModuleList([ep]), ep.comm
    )
    assert decoder.comm is ep.comm and decoder.moe[0] is ep


def test_a_layer_without_shared_experts_adds_nothing_for_them():
    import numpy as np

    from moeinfra.eplb import rebalance
    from moeinfra.moe.config import tiny
    from moeinfra.moe.expert_parallel import ExpertParallelMoE
    from moeinfra.moe.layers import build_moe

    config = tiny().replace(num_shared_experts=0)
    moe = build_moe(config, seed=4)
    assert moe.shared is None
    ep = ExpertParallelMoE(moe, rebalance(np.ones((1, 16)), 20, 4, 1, 1))
    x = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ep.shared_output(x), torch.zeros_like(x))
        assert torch.allclose(ep(x), moe(x), atol=1e-5)


def test_routing_by_hand_two_groups_one_expert_groups_and_bf16_softmax():
    from moeinfra.moe.gate import route

    # 2 groups of 2 (biased scores group 0: 0.9, 0.1; group 1: 0.6, 0.5): group 1's two best sum
    # to 1.1 > 1.0, so with one group per token both picks come from group 1, not expert 0
    scores = torch.tensor([[0.9, 0.1, 0.6, 0.5]])
    logits = torch.log(scores / (1 - scores))  # sigmoid(logits) = scores
    weights, indices = route(
        logits, torch.zeros(4), top_k=2, num_groups=2, groups_per_token=1, scaling_factor=1.0
    )
    assert indices.tolist() == [[2, 3]]
    assert torch.allclose(weights, torch.tensor([[0.6 / 1.1, 0.5 / 1.1]]))
    # one expert per group: a group's score is its expert's biased score; the best two groups win
    weights, indices = route(
        logits,
        torch.tensor([0.0, 0.0, 0.0, 0.2]),
        top_k=2,
        num_groups=4,
        groups_per_token=2,
        scaling_factor=2.0,
    )
    assert sorted(indices[0].tolist()) == [0, 3]
    # softmax scores are computed in float32 even for bf16 logits (as the reference gates do)
    bf16 = torch.tensor([[3.0, 2.5, -1.0, 0.75, 0.5, 0.125, 0.0, 1.5]], dtype=torch.bfloat16)
    weights, indices = route(
        bf16, None, top_k=3, num_groups=1, groups_per_token=1, scaling_factor=1.0, scoring="softmax"
    )
    expected = bf16.float().softmax(dim=-1).to(torch.bfloat16)
    assert indices.tolist() == [[0, 1, 7]]
    assert torch.equal(weights, expected[:, [0, 1, 7]])
