"""Benchmark of ``moeinfra.trace``: end-to-end ``report`` on DeepSeek's training trace and on a synthetic
50+ MB multi-stream trace (time and peak memory), side by side with Holistic Trace Analysis when a
separate venv with ``holistictraceanalysis`` exists (HTA is never a dependency of moeinfra).

Run: ``.venv/bin/python -m benchmarks.bench_trace [--reps 7] [--hta-python /tmp/htavenv/bin/python]``.
Prints Markdown tables of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from moeinfra.trace import analyze

DEEPSEEK_TRACE = (
    Path(__file__).resolve().parents[1] / "examples" / "data" / "deepseek_train_trace.json"
)
DEFAULT_HTA_PYTHON = "/tmp/htavenv/bin/python"

_GEMM = "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel>(dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel::Params)"
_ELEM = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)"
_DISPATCH = "void deep_ep::internode::dispatch<false, 8, true, 8>(int4*, float*, long*, float*, deep_ep::internode::SourceMeta*, int4 const*, float const*)"
_NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def synthetic_trace(path: Path, target_mb: float = 55.0, seed: int = 0) -> Path:
    """Write a Kineto-like trace of about ``target_mb`` MB: 4 streams (GEMM, elementwise, DeepEP, NCCL),
    memcpy, CPU ops, runtime launches with correlation ids, flows and F/B/W annotations."""
    rng = random.Random(seed)
    base = 1_700_000_000_000_000
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
    ]
    t_cpu, t_gpu, corr, size = base, base + 50, 1, 0
    phase_cycle = ("attn(F)", "mlp(B)", "dispatch(F)", "mlp(W)", "combine(B)")
    block = 0
    while size < target_mb * 1e6:
        name = phase_cycle[block % len(phase_cycle)]
        start_cpu = t_cpu
        chunk = []
        for _ in range(40):
            kind = rng.random()
            if kind < 0.45:
                kname, stream, grid, cat = _GEMM, 7, [112, 1, 1], "kernel"
            elif kind < 0.7:
                kname, stream, grid, cat = _ELEM, 7, [4096, 1, 1], "kernel"
            elif kind < 0.85:
                kname, stream, grid, cat = _DISPATCH, 27, [20, 1, 1], "kernel"
            elif kind < 0.95:
                kname, stream, grid, cat = _NCCL, 31, [16, 1, 1], "kernel"
            else:
                kname, stream, grid, cat = "Memcpy DtoD (Device -> Device)", 9, None, "gpu_memcpy"
            dur = rng.randint(2, 400)
            gstart = t_gpu + rng.randint(0, 30) if stream != 7 else t_gpu
            args = {
                "External id": corr,
                "queued": 0,
                "device": 0,
                "context": 1,
                "stream": stream,
                "correlation": corr,
            }
            if grid:
                args.update(
                    {
                        "registers per thread": 90,
                        "shared memory": 0,
                        "blocks per SM": 0.8,
                        "grid": grid,
                        "block": [384, 1, 1],
                        "est. achieved occupancy %": 19,
                    }
                )
            chunk.append(
                {
                    "ph": "X",
                    "cat": cat,
                    "name": kname,
                    "pid": 0,
                    "tid": stream,
                    "ts": gstart,
                    "dur": dur,
                    "args": args,
                }
            )
            chunk.append(
                {
                    "ph": "X",
                    "cat": "cpu_op",
                    "name": "aten::mm",
                    "pid": 1166,
                    "tid": 1166,
                    "ts": t_cpu,
                    "dur": 9,
                    "args": {"External id": corr, "Ev Idx": corr},
                }
            )
            chunk.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": 1166,
                    "tid": 1166,
                    "ts": t_cpu + 2,
                    "dur": 5,
                    "args": {"External id": corr, "cbid": 211, "correlation": corr},
                }
            )
            chunk.append(
                {
                    "ph": "s",
                    "id": corr,
                    "pid": 1166,
                    "tid": 1166,
                    "ts": t_cpu + 2,
                    "cat": "ac2g",
                    "name": "ac2g",
                }
            )
            chunk.append(
                {
                    "ph": "f",
                    "id": corr,
                    "pid": 0,
                    "tid": stream,
                    "ts": gstart,
                    "cat": "ac2g",
                    "name": "ac2g",
                    "bp": "e",
                }
            )
            corr += 1
            t_cpu += 10
            if stream == 7:
                t_gpu += dur + rng.randint(0, 3)
        chunk.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": name,
                "pid": 1166,
                "tid": 1166,
                "ts": start_cpu,
                "dur": t_cpu - start_cpu,
                "args": {"External id": corr},
            }
        )
        size += sum(len(json.dumps(e)) for e in chunk[:5]) * len(chunk) // 5
        events.extend(chunk)
        block += 1
    doc = {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "NVIDIA H800", "numSms": 132}],
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
        "traceEvents": events,
    }
    path.write_text(json.dumps(doc))
    return path


def _times(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _report(path: Path) -> dict:
    return analyze(path).to_dict()


def _peak_memory(path: Path) -> int:
    tracemalloc.start()
    _report(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


_RSS_SCRIPT = r"""
import resource, sys
from moeinfra.trace import analyze
import moeinfra.trace.timeline  # noqa: F401  (imports done before the baseline)


def peak_rss():
    # VmHWM belongs to this process image; ru_maxrss would inherit the parent's peak across fork.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


base = peak_rss()
analyze(sys.argv[1]).to_dict()
print(peak_rss() - base)
"""


def _peak_rss_increase(path: Path) -> int:
    """Growth of the peak resident set (bytes) of a fresh process while it reports on ``path``."""
    res = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return int(res.stdout.strip())


_HTA_SCRIPT = r"""
import json, statistics, sys, time, warnings, logging
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
trace_dir, reps = sys.argv[1], int(sys.argv[2])
times = []
for _ in range(reps):
    t = time.perf_counter()
    ta = TraceAnalysis(trace_dir=trace_dir)
    overlap = ta.get_comm_comp_overlap(visualize=False)
    times.append(time.perf_counter() - t)
print(json.dumps({"median_s": statistics.median(times), "overlap": overlap.to_dict(orient="records")}, default=str))
"""


def _hta(hta_python: str, trace_file: Path, reps: int) -> dict | None:
    """Time HTA (parse + comm/comp overlap) in its own venv; None when that venv is missing or fails."""
    if not Path(hta_python).exists():
        return None
    with tempfile.TemporaryDirectory(prefix="bench_trace_hta_") as tmp:
        os.symlink(trace_file.resolve(), Path(tmp) / "rank0.json")
        try:
            res = subprocess.run(
                [hta_python, "-c", _HTA_SCRIPT, tmp, str(reps)],
                capture_output=True,
                text=True,
                timeout=1800,
            )
        except subprocess.TimeoutExpired:
            return None
    if res.returncode != 0:
        print(f"HTA failed: {res.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--hta-python",
        default=DEFAULT_HTA_PYTHON,
        help="python of a venv with holistictraceanalysis",
    )
    parser.add_argument(
        "--hta-large-reps",
        type=int,
        default=1,
        help="HTA repetitions on the synthetic trace (0 = skip)",
    )
    parser.add_argument("--size-mb", type=float, default=55.0)
    args = parser.parse_args(argv)

    rows = []
    if DEEPSEEK_TRACE.exists():
        _report(DEEPSEEK_TRACE)  # warm up imports and caches
        # Ours before and after HTA, so both see the same (shared-machine) load.
        samples = _times(lambda: _report(DEEPSEEK_TRACE), args.reps)
        hta = _hta(args.hta_python, DEEPSEEK_TRACE, args.reps)
        ours = statistics.median(samples + _times(lambda: _report(DEEPSEEK_TRACE), args.reps))
        doc = _report(DEEPSEEK_TRACE)["devices"][0]
        rows.append(
            (
                f"DeepSeek train trace ({DEEPSEEK_TRACE.stat().st_size / 1e6:.1f} MB)",
                ours,
                None,
                hta,
                f"comm hidden {100 * doc['comm_hidden_fraction']:.1f}%",
            )
        )
    with tempfile.TemporaryDirectory(prefix="bench_trace_") as tmp:
        big = synthetic_trace(Path(tmp) / "synthetic.json", args.size_mb)
        size = big.stat().st_size
        _report(big)
        ours = statistics.median(_times(lambda: _report(big), args.reps))
        peak = _peak_memory(big)
        rss = _peak_rss_increase(big)
        hta = _hta(args.hta_python, big, args.hta_large_reps) if args.hta_large_reps > 0 else None
        doc = _report(big)["devices"][0]
        rows.append(
            (
                f"synthetic multi-stream ({size / 1e6:.1f} MB)",
                ours,
                f"{peak / size:.2f}x (tracemalloc), {rss / size:.2f}x (peak RSS growth)",
                hta,
                f"comm hidden {100 * doc['comm_hidden_fraction']:.1f}%",
            )
        )

    print(
        f"Medians of read + classify + decompose + attribute + JSON dict, in-process ({args.reps} runs; "
        f"on the DeepSeek trace {args.reps} before and {args.reps} after HTA's runs). HTA: "
        f"TraceAnalysis(trace_dir) + get_comm_comp_overlap() in its own venv, median of {args.reps} "
        f"(DeepSeek) / {args.hta_large_reps} (synthetic) runs.\n"
    )
    print(
        "| trace | moeinfra report | peak memory / file size | HTA parse + comm_comp_overlap | speed-up | result |"
    )
    print("|---|---|---|---|---|---|")
    for name, ours, ratio, hta, note in rows:
        hta_s = hta["median_s"] if hta else None
        print(
            f"| {name} | {ours * 1e3:.1f} ms | {'-' if ratio is None else ratio} | "
            f"{'n/a' if hta_s is None else f'{hta_s * 1e3:.0f} ms'} | {'-' if hta_s is None else f'{hta_s / ours:.0f}x'} | {note} |"
        )
    for name, _, _, hta, _ in rows:
        if hta:
            print(f"\nHTA comm_comp_overlap on {name}: {hta['overlap']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
