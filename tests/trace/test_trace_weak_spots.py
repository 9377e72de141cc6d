"""Attribution at the edges (issue #18): launches exactly at an annotation's start and end, and
correlation ids above 2^16 that repeat across the ranks of a multi-rank trace.

The rule (docs/trace-metrics.md, "Attribution"; attribution.py): an op's region is the innermost
(shortest) user annotation of its rank that encloses the *start* of its launch call, an annotation
covering the half-open interval ``[ts, ts + dur)``, like every interval of the trace model. So a
launch at an annotation's start belongs to it and a launch at its end does not.
"""

from __future__ import annotations

from trace_builders import annotation, kernel, launch, write_trace

from moeinfra.trace import analyze, launch_stats, read_trace
from moeinfra.trace.attribution import UNATTRIBUTED, attribute

# (launch start in µs, expected region, expected phase) for one launch each; annotations:
#   step [0, 100)
#     a(F) [10, 20)  b(B) [20, 30)  c(W) [40, 50) > inner [40, 45)
#     outer(F) [60, 90) > mid(B) [70, 80)
EDGES = [
    (0, "step", None),  # the start of the outermost annotation
    (10, "a(F)", "F"),  # a(F)'s start
    (19.999, "a(F)", "F"),  # 1 ns before its end
    (20, "b(B)", "B"),  # a(F)'s end = b(B)'s start: the later one
    (30, "step", None),  # b(B)'s end: back in step, which has no phase
    (40, "inner", "W"),  # the start of two: the shorter wins, the phase comes from c(W)
    (45, "c(W)", "W"),  # inner's end, inside c(W)
    (50, "step", None),  # c(W)'s end
    (80, "outer(F)", "F"),  # mid(B)'s end: outer's phase, not mid's
    (70, "mid(B)", "B"),
    (100, UNATTRIBUTED, None),  # the end of the outermost annotation
    (-0.001, UNATTRIBUTED, None),  # 1 ns before anything
]


def _edge_events(tid_of_launch: int = 1) -> list[dict]:
    events = [
        annotation("step", 0, 100),
        annotation("a(F)", 10, 10),
        annotation("b(B)", 20, 10),
        annotation("c(W)", 40, 10),
        annotation("inner", 40, 5),
        annotation("outer(F)", 60, 30),
        annotation("mid(B)", 70, 10),
    ]
    for corr, (ts, _, _) in enumerate(EDGES, start=1):
        events.append(launch(ts, corr, tid=tid_of_launch))
        events.append(kernel(f"k{corr}", 200 + 10 * corr, 5, corr=corr))
    return events


def _by_kernel(trace, attribution) -> dict[str, tuple[str, str | None]]:
    regions = attribution.region_names(trace).tolist()
    phases = [attribution.phases[p] if p >= 0 else None for p in attribution.phase]
    names = trace.gpu.op_names().tolist()
    return {n: (r, p) for n, r, p in zip(names, regions, phases, strict=True)}


def test_launches_at_an_annotations_start_and_end(tmp_path):
    trace = read_trace(write_trace(tmp_path / "t.json", _edge_events()))
    got = _by_kernel(trace, attribute(trace))
    for corr, (ts, region, phase) in enumerate(EDGES, start=1):
        assert got[f"k{corr}"] == (region, phase), f"launch at {ts} µs"


def test_the_edges_hold_for_launches_on_another_thread(tmp_path):
    # Annotations on the main thread, launches from another (DualPipe's autograd thread).
    trace = read_trace(write_trace(tmp_path / "t.json", _edge_events(tid_of_launch=9)))
    got = _by_kernel(trace, attribute(trace))
    assert [got[f"k{c}"] for c in range(1, len(EDGES) + 1)] == [(r, p) for _, r, p in EDGES]


def test_phase_breakdown_counts_each_edge_op_once(tmp_path):
    # 12 ops of 5 µs each, at distinct times: F gets 3 (a(F) twice, outer(F)), B 2, W 2,
    # the rest (step x3, outside x2) are unattributed.
    result = analyze(write_trace(tmp_path / "t.json", _edge_events()))
    phases = result.to_dict()["devices"][0]["phases"]
    assert {k: v["ops"] for k, v in phases.items()} == {"F": 3, "B": 2, "W": 2, UNATTRIBUTED: 5}
    assert {k: v["compute_us"] for k, v in phases.items()} == {
        "F": 15,
        "B": 10,
        "W": 10,
        UNATTRIBUTED: 25,
    }


# ---------------------------------------------------------------- correlation ids across ranks

BIG_IDS = [65_536, 65_537, 70_000, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 7]


def _rank_events(rank: int) -> list[dict]:
    """The same correlation ids on every rank; launches under a rank-specific annotation, with a
    rank-specific launch delay: rank r's op k starts (k + 1) * (r + 1) µs after its launch ends."""
    events = [annotation(f"rank{rank}(F)" if rank == 0 else f"rank{rank}(B)", 0, 1000)]
    for k, corr in enumerate(BIG_IDS):
        call_ts = 10 + 20 * k + rank  # launch calls of 1 µs
        events.append(launch(call_ts, corr))
        events.append(kernel(f"op{k}", call_ts + 1 + (k + 1) * (rank + 1), 2, corr=corr))
    return events


def test_repeated_correlation_ids_link_to_their_own_ranks_launch(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    for rank in (0, 1, 2):
        write_trace(folder / f"r{rank}.json", _rank_events(rank), distributedInfo={"rank": rank})
    trace = read_trace(folder)
    attribution = attribute(trace)
    gpu, cpu = trace.gpu, trace.cpu
    assert (attribution.launch >= 0).all()
    # each op's launch row is on the op's rank and has the op's correlation id
    assert (cpu.rank[attribution.launch] == gpu.rank).all()
    assert (cpu.correlation[attribution.launch] == gpu.correlation).all()
    regions = attribution.region_names(trace)
    for rank in (0, 1, 2):
        mine = gpu.rank == rank
        assert set(regions[mine].tolist()) == {f"rank{rank}(F)" if rank == 0 else f"rank{rank}(B)"}
    phases = [attribution.phases[p] for p in attribution.phase]
    assert [p for p, r in zip(phases, gpu.rank, strict=True) if r == 0] == ["F"] * len(BIG_IDS)
    # launch delays: op k of rank r waits (k + 1)(r + 1) µs after its own rank's call
    stats = {s.rank: s for s in launch_stats(trace)}
    for rank in (0, 1, 2):
        delays = [(k + 1) * (rank + 1) * 1000 for k in range(len(BIG_IDS))]
        assert stats[rank].launches == len(BIG_IDS)
        assert stats[rank].total_launch_delay_ns == sum(delays)
        assert stats[rank].launch_delay_ns["max"] == max(delays)


def test_a_correlation_id_of_another_rank_does_not_link(tmp_path):
    # rank 1 launches nothing with id 70,000 + 1; its op with that id stays unlinked, although
    # rank 0 has such a launch. Ids 2^40 + 5 (rank 0) and 5 (rank 1) must not be confused either.
    folder = tmp_path / "run"
    folder.mkdir()
    write_trace(
        folder / "r0.json",
        [
            annotation("zero(F)", 0, 100),
            launch(10, 70_001),
            kernel("a", 20, 2, corr=70_001),
            launch(30, 2**40 + 5),
            kernel("b", 40, 2, corr=2**40 + 5),
        ],
        distributedInfo={"rank": 0},
    )
    write_trace(
        folder / "r1.json",
        [
            annotation("one(B)", 0, 100),
            kernel("a", 20, 2, corr=70_001),
            launch(50, 5),
            kernel("b", 60, 2, corr=5),
        ],
        distributedInfo={"rank": 1},
    )
    trace = read_trace(folder)
    attribution = attribute(trace)
    gpu, cpu = trace.gpu, trace.cpu
    got = {
        (int(r), n): (int(cpu.rank[row]) if row >= 0 else None, reg)
        for r, n, row, reg in zip(
            gpu.rank,
            gpu.op_names().tolist(),
            attribution.launch,
            attribution.region_names(trace).tolist(),
            strict=True,
        )
    }
    assert got[(0, "a")] == (0, "zero(F)")
    assert got[(1, "a")] == (None, UNATTRIBUTED)
    assert got[(0, "b")] == (0, "zero(F)")
    assert got[(1, "b")] == (1, "one(B)")


def test_phases_in_order_f_b_w_then_others_by_name_and_the_named_group_wins(tmp_path):
    """attribute()'s docstring: the pattern's group ``phase`` names the phase (not group 1);
    phases list F, B, W first, then any other name alphabetically."""
    events = [
        annotation("mb0.W", 0, 10),
        annotation("mb0.X", 10, 10),
        annotation("mb0.A", 20, 10),
        annotation("mb0.B", 30, 10),
        annotation("mb0.F", 40, 10),
    ]
    for corr, ts in enumerate((1, 11, 21, 31, 41), start=1):
        events += [launch(ts, corr), kernel(f"k{corr}", 100 + 10 * corr, 5, corr=corr)]
    trace = read_trace(write_trace(tmp_path / "t.json", events))
    attribution = attribute(trace, r"(mb\d+)\.(?P<phase>\w)$")
    assert attribution.phases == ["F", "B", "W", "A", "X"]
    by_kernel = _by_kernel(trace, attribution)
    assert [by_kernel[f"k{c}"][1] for c in range(1, 6)] == ["W", "X", "A", "B", "F"]


def test_a_single_op_is_attributed_and_regions_add_up_by_hand(tmp_path):
    """One compute kernel launched inside "fwd" [0, 50) and one NCCL kernel launched inside "comm"
    [50, 100): each region holds its op; "comm"'s 20 µs of communication overlap the 10 µs GEMM for
    5 µs, so 15 µs are exposed."""
    from moeinfra.trace import classify
    from moeinfra.trace.attribution import region_breakdown

    one = [annotation("fwd", 0, 50), launch(5, 1), kernel("gemm", 100, 10, corr=1)]
    trace = read_trace(write_trace(tmp_path / "one.json", one))
    assert _by_kernel(trace, attribute(trace)) == {"gemm": ("fwd", None)}
    events = [
        *one,
        annotation("comm", 50, 50),
        launch(60, 2),
        kernel("ncclDevKernel_AllReduce", 105, 20, corr=2),
    ]
    trace = read_trace(write_trace(tmp_path / "two.json", events))
    regions = region_breakdown(trace, classify(trace.gpu), attribute(trace), slice(None))
    assert regions == {
        "comm": {"compute_us": 0.0, "comm_us": 20.0, "exposed_comm_us": 15.0, "ops": 1},
        "fwd": {"compute_us": 10.0, "comm_us": 0.0, "exposed_comm_us": 0.0, "ops": 1},
    }


def test_an_op_outside_every_annotation_has_no_region_index(tmp_path):
    """Attribution's docstring: -1 means none found (region and phase)."""
    events = [annotation("fwd(F)", 0, 10), launch(5, 1), launch(20, 2)]
    events += [kernel("inside", 30, 5, corr=1), kernel("outside", 40, 5, corr=2)]
    trace = read_trace(write_trace(tmp_path / "t.json", events))
    attribution = attribute(trace)
    by_name = dict(zip(trace.gpu.op_names().tolist(), range(2), strict=True))
    assert attribution.region[by_name["outside"]] == -1
    assert attribution.phase[by_name["outside"]] == -1
    assert attribution.region[by_name["inside"]] == 0
    names = attribution.region_names(trace)
    assert names.dtype == object and names[by_name["outside"]] == UNATTRIBUTED


def test_each_ranks_decomposition_names_its_rank_and_device(tmp_path):
    from moeinfra.trace import classify
    from moeinfra.trace.overlap import decompose

    folder = tmp_path / "run"
    folder.mkdir()
    for rank in (0, 1):
        events = [kernel("gemm", 10, 5 * (rank + 1), device=rank + 2)]
        write_trace(folder / f"r{rank}.json", events, distributedInfo={"rank": rank})
    trace = read_trace(folder)
    parts = decompose(trace, classify(trace.gpu))
    assert [(d.rank, d.device, d.compute_ns) for d in parts] == [(0, 2, 5000), (1, 3, 10000)]


def test_sm_use_counts_only_kernels_with_a_known_grid(tmp_path):
    """100 SMs; over [0, 40) µs: a 10 µs kernel on 50 blocks, a 30 µs kernel with no grid and a
    10 µs one with a zero grid (unknown, not counted): compute sm_share = 10 * 50 / (100 * 40).
    A zero-length NCCL kernel on 8 blocks: no share of time, its mean SMs its own 8."""
    events = [
        kernel("gemm_a", 0, 10, grid=[50, 1, 1]),
        kernel("gemm_b", 10, 30),
        kernel("gemm_c", 20, 10, grid=[0, 1, 1]),
        kernel("ncclDevKernel_AllReduce", 5, 0, stream=8, grid=[8, 1, 1]),
    ]
    props = [{"id": 0, "name": "Test GPU", "numSms": 100}]
    result = analyze(write_trace(tmp_path / "t.json", events, deviceProperties=props))
    sm = result.to_dict()["devices"][0]["sm_share"]["compute"]
    assert sm["sm_share"] == 10 * 50 / (100 * 40)
    assert sm["mean_sms"] == 50 and sm["max_sms"] == 50
    comm = result.to_dict()["devices"][0]["sm_share"]["communication"]
    assert comm == {"sm_share": 0.0, "mean_sms": 8.0, "max_sms": 8}


def test_no_intervals_cover_nothing_in_whole_nanoseconds():
    from moeinfra.trace import intervals

    empty = intervals.union([], [])
    got = intervals.covered_before(empty, [0, 5])
    assert (
        got.tolist() == [0, 0]
        and got.dtype
        == intervals.covered_before(intervals.union([0], [3]), [0, 5]).dtype
        == "int64"
    )


def test_a_kernel_links_to_the_first_runtime_call_of_its_correlation_id(tmp_path):
    """The runtime call and the driver call inside it share the kernel's correlation id (as
    cudaLaunchKernel and cuLaunchKernel do): the link goes to the first (outer) call, for each of
    20 kernels."""
    # ids out of time order, as an unstable sort of the (rank, id) keys would reorder the pairs
    ids = [5, 20, 7, 3, 14, 17, 4, 12, 11, 9, 1, 13, 8, 6, 19, 18, 15, 10, 2, 16]
    events = []
    for k, corr in enumerate(ids):
        events.append(launch(10.0 * k, corr, dur=3))
        events.append(launch(10.0 * k + 1, corr, dur=1, name="cuLaunchKernel"))
        events.append(kernel(f"k{corr}", 500 + 10 * k, 5, corr=corr))
    trace = read_trace(write_trace(tmp_path / "t.json", events))
    links = attribute(trace).launch
    cpu = trace.cpu
    started = {corr: 10_000 * k for k, corr in enumerate(ids)}
    assert cpu.start_ns[links].tolist() == [started[c] for c in trace.gpu.correlation.tolist()]
    assert {cpu.names[i] for i in cpu.name_id[links]} == {"cudaLaunchKernel"}
