"""Bad input to the serving commands: one line naming the argument, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

DECODE_UNIT = ["serve", "unit", "--server", "tcp://h:1", "--role", "decode"]
SPANNING = ["--ranks", "4", "--nproc-per-node", "2"]  # a unit over two hosts


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["serve", "bench", "--url", "http://127.0.0.1:9", "-n", "2", "-q"], "--url="),
        (["serve", "bench", "--url", "http://127.0.0.1:9", "--rate", "0"], "--rate=0"),
        (
            ["serve", "bench", "--url", "http://127.0.0.1:9", "--max-concurrency", "0"],
            "--max-concurrency=0",
        ),
        (["serve", "unit", "--server", "bogus", "--role", "decode"], "--server='bogus'"),
        (["serve", "unit", "--server", "tcp://h:1", "--role", "judge"], "--role='judge'"),
        ([*DECODE_UNIT, "--nproc-per-node", "3"], "--nproc-per-node=3"),
        ([*DECODE_UNIT, "--node-rank", "1"], "--node-rank=1"),
        ([*DECODE_UNIT, *SPANNING, "--node-rank", "2"], "--node-rank=2"),
        ([*DECODE_UNIT, *SPANNING, "--node-rank", "1"], "--master-addr"),
        ([*DECODE_UNIT, "--ranks", "3", "--nproc-per-node", "2"], "--nproc-per-node=2 must divide"),
        ([*DECODE_UNIT, "--max-restarts", "-1"], "--max-restarts=-1"),
        ([*DECODE_UNIT, "--cpu-threads", "0"], "--cpu-threads=0"),
        (["serve", "up", "--prefill-units", "-1"], "--prefill-units=-1"),
        (["serve", "up", "--cpu-threads", "0"], "--cpu-threads=0"),
        (["serve", "up", "--memory-utilization", "0"], "--memory-utilization=0.0"),
        (["serve", "up", "--num-kv-blocks", "0"], "--num-kv-blocks=0"),
        (["serve", "up", "--decode-units", "0"], "--prefill-units=1 needs --decode-units"),
        (["serve", "up", "--unit-timeout", "500ms"], "--unit-timeout=0.5"),
        (["serve", "up", "--drain-timeout", "-1s"], "--drain-timeout=-1.0"),
        (["serve", "up", "--drain-timeout", "30"], "--drain-timeout=30 needs a unit"),
        (["serve", "calibrate"], "exactly one of --url"),
        (
            ["serve", "calibrate", "--url", "http://x", "--measurements", "m"],
            "exactly one of --url",
        ),
        (["serve", "calibrate", "--url", "http://127.0.0.1:9"], "--url="),
        (["serve", "calibrate", "--measurements", "missing.json"], "--measurements="),
        (["serve", "model", "--calibration", "missing.json"], "--calibration=missing.json"),
        (["serve", "simulate", "--calibration", "none", "--tick", "0s"], "--tick='0s'"),
        (["serve", "up", "--kv-connector", "nixl"], "--kv-connector='nixl'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, names):
    r = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in r.stderr


def test_a_unit_command_passes_the_comm_delay_with_its_unit(tmp_path):
    """``serve up --comm-delay 2ms`` hands the delay to its units as ``--comm-delay 0.002s``: a
    bare number would be refused by ``serve unit``."""
    from moeinfra.cli.options import parse_duration_s
    from moeinfra.server.launch import ServeOptions, unit_command

    cmd = unit_command("decode", 1, "tcp://127.0.0.1:1", ServeOptions(comm_delay_s=2e-3), tmp_path)
    value = cmd[cmd.index("--comm-delay") + 1]
    assert value == "0.002s" and parse_duration_s(value, "--comm-delay") == 2e-3


def test_default_layout_gives_each_rank_a_core_or_falls_back_to_one_colocated_rank(monkeypatch):
    """``serve up`` without a layout: 1 prefill + 1 decode unit of 2 ranks where the machine has
    a core per rank and one for the API server (CPU), else one colocated unit of one rank."""
    from moeinfra.server import launch

    monkeypatch.setattr(launch.os, "cpu_count", lambda: 16)
    assert launch.default_layout("cpu") == launch.DISAGGREGATED
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 2)
    layout = launch.default_layout("cpu")
    assert layout == launch.ONE_COLOCATED_RANK
    options = launch.ServeOptions(**layout)
    assert (options.prefill_units, options.decode_units, options.colocated_units) == (0, 0, 1)
    assert options.colocated_ranks == 1


def test_ranks_share_the_hosts_cores_unless_omp_num_threads_says(monkeypatch, tmp_path):
    """Each rank's CPU threads: OMP_NUM_THREADS when set, else the usable cores shared by the
    ranks ``serve up`` may run on this host (the autoscaler's ceiling included); the count
    reaches every unit's command line."""
    from moeinfra.server import unit
    from moeinfra.server.autoscale import AutoscalePolicy
    from moeinfra.server.launch import ServeOptions, local_ranks, unit_command

    monkeypatch.setattr(unit.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert unit.threads_per_rank(4) == 4 and unit.threads_per_rank(1) == 16
    assert unit.threads_per_rank(32) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert unit.threads_per_rank(4) == 3
    assert local_ranks(ServeOptions()) == 4  # one prefill and one decode unit of 2 ranks
    colocated = ServeOptions(prefill_units=0, decode_units=0, colocated_units=1, colocated_ranks=1)
    assert local_ranks(colocated) == 1
    scaling = ServeOptions(autoscale=AutoscalePolicy((1, 3), (1, 2), 10.0, 0.7))
    assert local_ranks(scaling) == 3 * 2 + 2 * 2

    cmd = unit_command("decode", 2, "tcp://127.0.0.1:1", ServeOptions(cpu_threads=5), tmp_path)
    assert cmd[cmd.index("--cpu-threads") + 1] == "5"


def test_serve_up_warns_when_its_ranks_threads_outnumber_the_cores(monkeypatch):
    """Four local ranks of 2 threads (``OMP_NUM_THREADS=2``, as a benchmark pinned to 2 cores set
    it) on 2 cores: one line names the counts and the way out; sharing the cores, none."""
    from moeinfra.server import launch, unit
    from moeinfra.server.launch import ServeOptions, oversubscription_note

    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(unit.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    note = oversubscription_note(ServeOptions())
    assert "4 local ranks x 2 CPU threads each on 2 cores" in note and "oversubscribed" in note
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert oversubscription_note(ServeOptions()) is None  # one thread a rank: all it can do
    colocated = ServeOptions(
        prefill_units=0, decode_units=0, colocated_units=1, colocated_ranks=1, cpu_threads=2
    )
    assert oversubscription_note(colocated) is None


def test_units_share_the_hosts_memory_and_max_model_len_fits_their_caches(tmp_path):
    """Each local unit sized from memory gets its ranks' part of --memory-utilization (a fixed
    size passes unchanged); max_model_len is lowered to a rank's cache unless asked for: then
    the server refuses to start, as vLLM does."""
    from dataclasses import replace

    from moeinfra.engine import EngineConfig
    from moeinfra.errors import InputError
    from moeinfra.server.launch import ServeOptions, check_model_len, unit_command, unit_engine

    options = ServeOptions(prefill_ranks=1, decode_ranks=3)  # 4 ranks on this host
    assert unit_engine(options, 1).memory_utilization == pytest.approx(0.9 / 4)
    assert unit_engine(options, 3).memory_utilization == pytest.approx(0.9 * 3 / 4)
    fixed = replace(options, engine=EngineConfig(num_kv_blocks=64))
    assert unit_engine(fixed, 1) == fixed.engine
    local = replace(options, engine=unit_engine(options, 3))
    cmd = unit_command("decode", 3, "tcp://127.0.0.1:1", local, tmp_path)
    assert float(cmd[cmd.index("--memory-utilization") + 1]) == pytest.approx(0.675)
    assert check_model_len(163840, 4096, ServeOptions()) == 4096
    assert check_model_len(1024, 4096, ServeOptions(max_model_len=1024)) == 1024
    with pytest.raises(InputError, match="--max-model-len=8192 exceeds one rank's KV cache"):
        check_model_len(8192, 4096, ServeOptions(max_model_len=8192))
