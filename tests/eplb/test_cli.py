import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from moeinfra.eplb import Plan
from moeinfra.eplb.loadfile import read_load
from moeinfra.eplb.published import EXAMPLE_PHY2LOG, EXAMPLE_WEIGHT


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "eplb", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


EXAMPLE_ARGS = ("--replicas", "16", "--groups", "4", "--nodes", "2", "--gpus", "8")


def test_plan_eval_show_round_trip(tmp_path):
    load = tmp_path / "load.npy"
    np.save(load, EXAMPLE_WEIGHT)
    plan_path = tmp_path / "plan.npz"
    result = cli(
        "plan",
        "--load",
        str(load),
        *EXAMPLE_ARGS,
        "--policy",
        "deepseek",
        "-o",
        str(plan_path),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["layers"] == 2 and payload["policy"] == "deepseek"
    np.testing.assert_array_equal(Plan.load(plan_path).phy2log, EXAMPLE_PHY2LOG)

    result = cli("eval", "--plan", str(plan_path), "--load", str(load), "--json")
    assert result.returncode == 0, result.stderr
    evaluation = json.loads(result.stdout)
    assert evaluation["summary"]["balancedness"] == pytest.approx(
        payload["summary"]["balancedness"]
    )
    assert len(evaluation["per_layer"]["gap"]) == 2

    figure = tmp_path / "fig.png"
    result = cli("show", "--plan", str(plan_path), "-o", str(figure))
    assert result.returncode == 0, result.stderr
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_migration_through_the_cli(tmp_path):
    rng = np.random.default_rng(0)
    load = rng.lognormal(0, 1, (4, 64)) * 100
    np.save(tmp_path / "a.npy", load)
    np.save(tmp_path / "b.npy", load * rng.lognormal(0, 0.02, load.shape))
    args = ("--replicas", "96", "--groups", "8", "--nodes", "2", "--gpus", "16")
    assert (
        cli(
            "plan", "--load", str(tmp_path / "a.npy"), *args, "-o", str(tmp_path / "a.npz")
        ).returncode
        == 0
    )
    result = cli(
        "plan",
        "--load",
        str(tmp_path / "b.npy"),
        *args,
        "--previous",
        str(tmp_path / "a.npz"),
        "--max-moves",
        "20",
        "-o",
        str(tmp_path / "b.npz"),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)["migration"]
    assert info["slots_changed"] <= 20
    assert info["bytes"] == info["transfers"] * 44_040_192


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ("--replicas", "15", "--groups", "4", "--nodes", "2", "--gpus", "8"),
            "multiple of num_gpus=8",
        ),
        (
            ("--replicas", "16", "--groups", "4", "--nodes", "2", "--gpus", "8", "--policy", "x"),
            "policy='x'",
        ),
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, args, message):
    load = tmp_path / "load.json"
    load.write_text(json.dumps(EXAMPLE_WEIGHT.tolist()))
    out = tmp_path / "plan.npz"
    result = cli("plan", "--load", str(load), *args, "-o", str(out))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_missing_load_file_is_a_clear_error(tmp_path):
    result = cli(
        "plan", "--load", str(tmp_path / "nope.npy"), *EXAMPLE_ARGS, "-o", str(tmp_path / "p.npz")
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: --load={tmp_path / 'nope.npy'}: no such file"


@pytest.mark.parametrize(
    "args,message",
    [
        (("eval", "--plan", "missing.npz", "--load", "load.npy"), "--plan=missing.npz: no such file"),
        (("eval", "--plan", "folder", "--load", "load.npy"), "--plan=folder: is a folder"),
        (("eval", "--plan", "plan.npz", "--load", "folder"), "--load=folder: is a folder"),
        (("show", "--plan", "plan.npz", "-o", "folder"), "--out=folder: is a folder"),
        (("plan", "--load", "load.npy", *EXAMPLE_ARGS, "-o", "load.npy/p.npz"),
         "--out=load.npy/p.npz: load.npy is a file, not a folder"),
        (("plan", "--load", "load.npy", *EXAMPLE_ARGS, "--previous", "old.npz", "-o", "p.npz"),
         "--previous=old.npz: no such file"),
    ],
)  # fmt: skip
def test_file_options_name_the_option_and_the_problem(tmp_path, args, message):
    (tmp_path / "folder").mkdir()
    np.save(tmp_path / "load.npy", EXAMPLE_WEIGHT)
    assert cli("plan", "--load", str(tmp_path / "load.npy"), *EXAMPLE_ARGS, "-o",
               str(tmp_path / "plan.npz")).returncode == 0  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "eplb", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    """(Checked through ``os.access``: the tests may run as root, who reads everything.)"""
    import os

    from moeinfra.cli.options import input_file
    from moeinfra.errors import InputError

    path = tmp_path / "load.npy"
    path.write_bytes(b"")
    monkeypatch.setattr(os, "access", lambda *_: False)
    with pytest.raises(
        InputError, match=r"^--load=.*load\.npy: not readable \(permission denied\)$"
    ):
        input_file(path, "--load")


def test_bench_progress_is_a_clean_bar_on_a_terminal_and_silent_otherwise():
    """On a terminal: a tqdm bar on stderr naming the configuration (no logging file:line
    column), cleared at the end; not a terminal, or --quiet: nothing on stderr. The table is on
    stdout either way."""
    import fcntl
    import os
    import struct
    import termios

    def bench(*flags: str, tty: bool) -> tuple[str, str]:
        if not tty:
            result = cli("bench", "--repeats", "1", *flags)
            assert result.returncode == 0, result.stderr
            return result.stdout, result.stderr
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        proc = subprocess.Popen(
            [sys.executable, "-m", "moeinfra.cli", "eplb", "bench", "--repeats", "1", *flags],
            stdout=subprocess.PIPE,
            stderr=slave,
        )
        os.close(slave)
        err = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            err += chunk
        os.close(master)
        out = proc.stdout.read().decode()
        assert proc.wait(timeout=120) == 0, err
        return out, err.decode(errors="replace")

    out, err = bench(tty=True)
    assert out.startswith("| deployment |") and "prefill / zipf" in err and "config" in err
    assert not re.search(r"\w+\.py:\d+", err), err
    assert err.endswith("\r")  # the bar is cleared: nothing left on the terminal
    for flags, tty in (((), False), (("--quiet",), True)):
        out, err = bench(*flags, tty=tty)
        assert out.startswith("| deployment |") and err == "", (flags, err)


def test_read_load_formats(tmp_path):
    np.savez(tmp_path / "a.npz", load=EXAMPLE_WEIGHT, other=np.zeros(3))
    torch.save({"weight": torch.tensor(EXAMPLE_WEIGHT)}, tmp_path / "a.pt")
    (tmp_path / "a.json").write_text(json.dumps({"counts": EXAMPLE_WEIGHT.tolist()}))
    np.savetxt(tmp_path / "a.csv", EXAMPLE_WEIGHT, delimiter=",")
    for name in ("a.npz", "a.pt", "a.json", "a.csv"):
        np.testing.assert_array_equal(read_load(tmp_path / name), EXAMPLE_WEIGHT)
    (tmp_path / "bad.json").write_text("[[1, 2], [3")
    with pytest.raises(ValueError, match="cannot be read"):
        read_load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="must end in one of"):
        read_load(tmp_path / "a.txt")


def test_bench_runs_small(tmp_path):
    from moeinfra.eplb.bench import markdown_table, run_benchmark

    rows = run_benchmark(repeats=1, kinds=("zipf",), layers=2)
    assert {row["deployment"] for row in rows} == {"prefill", "decode"}
    assert all(row["default_max_over_mean"] <= row["deepseek_max_over_mean"] + 1e-9 for row in rows)
    assert markdown_table(rows).count("\n") == len(rows) + 1


def test_eval_of_a_corrupt_plan_is_one_line_and_exit_2(tmp_path):
    load = tmp_path / "load.npy"
    np.save(load, EXAMPLE_WEIGHT)
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    for plan in (str(load), str(tmp_path / "list.json")):  # a load file, a JSON list
        result = cli("eval", "--plan", plan, "--load", str(load))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert (
            len(result.stderr.strip().splitlines()) == 1 and "not a moeinfra plan" in result.stderr
        )
