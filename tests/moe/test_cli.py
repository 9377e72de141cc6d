"""``moeinfra moe run`` round trips: JSON fields, reference error, trace readable, bad input exit 2."""

import json
import re
import subprocess
import sys

import pytest


def _cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "moe", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(150)
def test_run_json_and_trace(tmp_path):
    trace = tmp_path / "moe.json"
    proc = _cli(
        "--world-size", "2", "--preset", "tiny", "--tokens", "96", "--redundant", "2",
        "--overlap", "prefill", "--steps", "1", "--delay-ms", "1", "--trace", str(trace), "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in (
        "world_size", "tokens", "overlap", "max_abs_error_vs_reference", "per_rank_time_s",
        "expert_load", "balancedness_before", "balancedness_after", "comm_hidden_fraction",
    ):  # fmt: skip
        assert key in out, key
    assert out["world_size"] == 2 and out["tokens"] == 96 and out["overlap"] == "prefill"
    assert out["max_abs_error_vs_reference"] <= 1e-5
    assert out["max_abs_error_after_rebalance"] <= 1e-5
    assert len(out["per_rank_time_s"]) == 2
    load = out["expert_load"]
    assert len(load) == 2 and len(load[0]) == 16  # [layers][experts]
    assert sum(load[0]) == 2 * 96 * 4  # every token's top-4 copies on both ranks
    assert 0 < out["balancedness_before"] <= out["balancedness_after"] <= 1
    assert 0 < out["comm_hidden_fraction"] <= 1
    assert "torchrun --nproc-per-node 2" in out["torchrun_command"]
    analyze = pytest.importorskip("moeinfra.trace").analyze
    devices = analyze(trace).to_dict()["devices"]
    assert len(devices) == 2
    mine = out["per_rank_comm_hidden_fraction"]
    for dev in devices:
        assert dev["comm_hidden_fraction"] == pytest.approx(mine[dev["device"]], abs=1e-3)


def test_bad_input_is_one_line_and_exit_2():
    proc = _cli("--world-size", "2", "--redundant", "1", timeout=60)
    assert proc.returncode == 2
    assert "must be a multiple of world_size=2" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"world_size": 2, "redundant": 1}, "17 slots must be a multiple of world_size=2"),
        ({"overlap": "sometimes"}, "overlap='sometimes'"),
        ({"preset": "huge"}, "preset='huge'"),
        ({"tokens": -1}, "tokens=-1"),
        ({"world_size": 0}, "world_size=0"),
        ({"preset": "deepseek_v3"}, "needs 46 GB of float32 weights"),
    ],
)
def test_run_config_rejects_bad_input(changes, message):
    from moeinfra.errors import InputError
    from moeinfra.moe.run import RunConfig

    with pytest.raises(InputError, match=re.escape(message)):
        RunConfig(**changes).validate()


def test_schedule_command():
    from typer.testing import CliRunner

    from moeinfra.cli.moe import app

    result = CliRunner().invoke(
        app, ["schedule", "--overlap", "prefill", "--layers", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    ops = json.loads(result.stdout)
    assert ops[:4] == ["ATTN(mb1)L0", "DISPATCH(mb1)L0", "ATTN(mb0)L0", "DISPATCH(mb0)L0"]
    table = CliRunner().invoke(app, ["schedule", "--overlap", "decode"])
    assert table.exit_code == 0 and "ATTN1(mb1)L0" in table.stdout


def test_run_prints_the_torchrun_command_and_trace_path_unwrapped(monkeypatch, tmp_path):
    """The lines meant to be pasted (the torchrun command, the trace path) are never wrapped to
    the terminal's width."""
    import importlib

    from typer.testing import CliRunner

    from moeinfra.cli.moe import app
    from moeinfra.moe.run import RunConfig

    moe_run = importlib.import_module(
        "moeinfra.moe.run"
    )  # the module (moeinfra.moe.run: a function)

    command = RunConfig(world_size=2, preset="tiny", tokens=96).torchrun_command()
    trace = tmp_path / ("a-rather-long-folder-name-" * 3) / "moe.json"
    result = {
        "per_rank_time_s": [0.01, 0.011],
        "per_rank_comm_hidden_fraction": [0.5, None],
        "step_times_s": [0.011],
        "step_time_s": 0.011,
        "expert_load": [[1, 2, 3]],
        "max_abs_error_vs_reference": 1e-7,
        "experts_migrated": 0,
        "max_abs_error_after_rebalance": 1e-7,
        "balancedness_before": 0.9,
        "balancedness_after": 0.95,
        "comm_hidden_fraction": 0.5,
        "torchrun_command": command,
        "trace": str(trace),
    }
    monkeypatch.setattr(moe_run, "run", lambda config, trace_path, timeout_s: result)
    monkeypatch.setenv("COLUMNS", "60")
    out = CliRunner().invoke(app, ["run", "--trace", str(trace)])
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert len(command) > 60 and f"same run under torchrun: {command}" in lines
    assert f"trace written to {trace}" in lines
