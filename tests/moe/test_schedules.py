"""Overlap schedules follow DeepSeek's published orders; micro-batch splitting; timeline metrics."""

import json

import pytest
import torch

from moeinfra.errors import InputError
from moeinfra.moe.mla import Segment
from moeinfra.moe.runtime import attention_cost, split_micro_batches
from moeinfra.moe.schedules import schedule
from moeinfra.moe.timeline import (
    COMM_TRACK,
    COMPUTE_TRACK,
    chrome_trace,
    overlap,
    write_chrome_trace,
)


def _layer_ops(ops, layer_of_attn):
    """Ops between the first ATTN(mb1) of ``layer_of_attn`` and the next one."""
    starts = [i for i, op in enumerate(ops) if op.kind == "ATTN" and op.micro_batch == 1]
    return ops[starts[layer_of_attn] : starts[layer_of_attn + 1]]


def test_prefill_order_is_deepseeks():
    ops = schedule("prefill", 4)
    period = _layer_ops(ops, 2)  # steady state
    compute = [
        f"{op.kind}(mb{op.micro_batch})" for op in period if op.kind not in ("DISPATCH", "COMBINE")
    ]
    assert compute == [
        "ATTN(mb1)",
        "SHARED(mb0)",
        "ATTN(mb0)",
        "MLP(mb1)",
        "MLP(mb0)",
        "SHARED(mb1)",
    ]
    comm = [f"{op.kind}(mb{op.micro_batch})" for op in ops if op.kind in ("DISPATCH", "COMBINE")]
    # COMBINE(mb0) | DISPATCH(mb1) | DISPATCH(mb0) | COMBINE(mb1), repeating.
    assert comm[3:7] == ["COMBINE(mb0)", "DISPATCH(mb1)", "DISPATCH(mb0)", "COMBINE(mb1)"]


def test_decode_order_is_the_five_stage_pipeline():
    ops = schedule("decode", 5)
    compute = [(op.kind, op.micro_batch) for op in ops if op.kind not in ("DISPATCH", "COMBINE")]
    steady = compute[8:16]
    kinds = [k for k, _ in steady]
    start = kinds.index("SHARED")
    rotated = steady[start:] + steady[:start]
    assert [k for k, _ in rotated] == ["SHARED", "ATTN0", "MLP", "ATTN1"] * 2
    assert [m for _, m in rotated][:4] in ([0, 1, 0, 1], [1, 0, 1, 0])  # alternating micro-batches
    for i, op in enumerate(ops):  # DISPATCH right after ATTN1, COMBINE right after MLP, same mb
        if op.kind in ("DISPATCH", "COMBINE"):
            prev = ops[i - 1]
            assert prev.kind == {"DISPATCH": "ATTN1", "COMBINE": "MLP"}[op.kind]
            assert (prev.micro_batch, prev.layer) == (op.micro_batch, op.layer)


@pytest.mark.parametrize("mode", ["none", "prefill", "decode"])
@pytest.mark.parametrize("layers", [1, 3])
def test_every_op_once_and_dependencies_hold(mode, layers):
    ops = schedule(mode, layers)
    assert len(ops) == len(set(ops))
    pos = {(op.kind, op.micro_batch, op.layer): i for i, op in enumerate(ops)}
    mbs = {op.micro_batch for op in ops}
    attn_end = "ATTN" if mode != "decode" else "ATTN1"
    for mb in mbs:
        for layer in range(layers):

            def p(kind, mb=mb, layer=layer):
                return pos[(kind, mb, layer)]

            assert p(attn_end) < p("DISPATCH") < p("MLP") < p("COMBINE")
            assert p(attn_end) < p("SHARED")
            if mode == "decode":
                assert p("ATTN0") < p("ATTN1")
            if layer:
                first = "ATTN" if mode != "decode" else "ATTN0"

                def prev(kind, mb=mb, layer=layer):
                    return pos[(kind, mb, layer - 1)]

                assert prev("COMBINE") < p(first) and prev("SHARED") < p(first)
    with pytest.raises(InputError, match="overlap='fast'"):
        schedule("fast", 2)


def test_split_balances_tokens_and_splits_at_most_one_sequence():
    segments = [Segment(i, 0, n) for i, n in enumerate([64, 64, 64, 20, 100, 7])]
    total = sum(s.length for s in segments)
    split = split_micro_batches(segments)
    t0, t1 = split.tokens()
    assert abs(t0 - t1) <= 1 and t0 + t1 == total
    rows = torch.sort(torch.cat(split.rows)).values
    assert torch.equal(rows, torch.arange(total))
    seqs = [s.seq for segs in split.segments for s in segs]
    assert len(seqs) - len(set(seqs)) <= 1
    for s in split.segments[0]:  # a split sequence's prefix is in micro-batch 1 (attended first)
        if s.start:
            assert any(p.seq == s.seq and p.start + p.length == s.start for p in split.segments[1])
    c0, c1 = split.attention_costs()
    assert c0 + c1 >= sum(attention_cost(0, s.length) for s in segments)
    whole = split_micro_batches(segments, allow_split=False)
    assert all(s.start == 0 for segs in whole.segments for s in segs)
    assert split_micro_batches([]).tokens() == (0, 0)


def test_attention_cost():
    assert attention_cost(0, 4) == 1 + 2 + 3 + 4
    assert attention_cost(2, 2) == 3 + 4


def test_overlap_of_intervals_and_chrome_trace(tmp_path):
    events = [
        ("A", COMPUTE_TRACK, 0.0, 2.0),
        ("B", COMPUTE_TRACK, 1.0, 3.0),
        ("d", COMM_TRACK, 2.5, 5.0),
        ("c", COMM_TRACK, 4.0, 6.0),
        ("C", COMPUTE_TRACK, 5.5, 7.0),
    ]
    ov = overlap(events)
    assert ov.compute_s == pytest.approx(4.5)
    assert ov.comm_s == pytest.approx(3.5)
    assert ov.overlap_s == pytest.approx(1.0)
    assert ov.hidden_fraction == pytest.approx(1.0 / 3.5)
    assert overlap([("A", COMPUTE_TRACK, 0.0, 1.0)]).hidden_fraction is None
    doc = chrome_trace([events, events[:2]])
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    assert all(e["name"].startswith("gloo:") == (e["tid"] == COMM_TRACK) for e in xs)
    path = write_chrome_trace(tmp_path / "t.json", [events])
    assert json.loads(path.read_text())["traceEvents"]


def test_trace_package_reads_the_timeline(tmp_path):
    analyze = pytest.importorskip("moeinfra.trace").analyze
    scale = 1e-3  # seconds -> ms-sized events
    events = [
        ("ATTN", COMPUTE_TRACK, 0.0, 2.0 * scale),
        ("DISPATCH", COMM_TRACK, 1.0 * scale, 4.0 * scale),
        ("MLP", COMPUTE_TRACK, 3.0 * scale, 5.0 * scale),
    ]
    path = write_chrome_trace(tmp_path / "t.json", [events, events])
    devices = analyze(path).to_dict()["devices"]
    assert len(devices) == 2
    for dev in devices:
        assert dev["comm_hidden_fraction"] == pytest.approx(
            overlap(events).hidden_fraction, abs=1e-6
        )
