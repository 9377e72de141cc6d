import os
import re
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_subcommands():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "eplb" in result.stdout
    assert "demo" in result.stdout


def test_unknown_subcommand_exits_2_without_traceback():
    result = run_cli("no-such-command")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_each_group_is_listed_with_its_own_help_and_loads_on_its_own():
    """``moeinfra --help`` lists every group by the help its module gives, without importing the
    groups; running one group imports that group only (no numba for ``trace``)."""
    import importlib

    from moeinfra.cli.main import GROUPS

    for name, (module, text) in GROUPS.items():
        assert importlib.import_module(module).app.info.help == text, name
    probe = (
        "import sys; from moeinfra.cli.main import build_app; {}; "
        "print(sorted(m for m in ('numba', 'torch', 'moeinfra.eplb', 'moeinfra.server') "
        "if m in sys.modules))"
    )
    for build, heavy in (("build_app(())", "[]"), ("build_app(('trace',))", "[]")):
        out = subprocess.run(
            [sys.executable, "-c", probe.format(build)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0 and out.stdout.strip() == heavy, out.stdout + out.stderr


def test_every_group_still_runs_through_the_console_entry():
    for name in ("engine", "eplb", "moe", "pipeline", "serve", "trace"):
        result = run_cli(name, "--help")
        assert result.returncode == 0 and "Commands" in result.stdout, (name, result.stderr)
    assert "up" in run_cli("serve", "--help").stdout  # the live server's commands too


def test_python_dash_m_moeinfra_is_the_moeinfra_command():
    as_module = subprocess.run(
        [sys.executable, "-m", "moeinfra", "eplb", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert as_module.returncode == 0, as_module.stderr
    assert "Usage: python -m moeinfra eplb" in as_module.stdout
    commands = lambda text: re.findall(r"^│ (\w+) ", text, flags=re.M)  # noqa: E731
    assert commands(as_module.stdout) == commands(run_cli("eplb", "--help").stdout)
    assert "warm" in commands(as_module.stdout)


def test_usage_errors_are_one_line_exit_2_without_the_usage_box(tmp_path):
    """Missing or extra arguments, missing options, unknown options and out-of-range values of any
    command: one line on stderr naming what was wrong, exit code 2, no box, no traceback."""
    trace = tmp_path / "a.json"
    trace.write_text("[]")
    cases = [
        (
            ("trace", "diff", str(trace)),
            "error: missing argument 'B' (usage: python -m moeinfra.cli trace diff [OPTIONS] A B)",
        ),
        (
            ("trace", "diff", str(trace), str(trace), "c"),
            "error: got unexpected extra argument(s) (c) (usage: python -m moeinfra.cli trace diff [OPTIONS] A B)",
        ),
        (("serve", "unit"), "error: missing option '--server'"),
        (("eplb", "bench", "--repeats", "0"), "error: --repeats=0: 0 is not in the range x>=1"),
        (("eplb", "bench", "--repeats=x"), "error: --repeats=x: 'x' is not a valid int"),
        (("eplb", "bench", "--repets", "2"), "error: no such option: --repets (did you mean"),
        (("eplb", "plan", "--load"), "error: option '--load' requires an argument"),
        (
            ("eplb", "nope"),
            "error: no such command 'nope' (commands: plan, eval, show, bench, warm)",
        ),
        (
            ("pipeline", "simulate", "-s", "1f1b", "-r", "x"),
            "error: --ranks=x: 'x' is not a valid int",
        ),
        (
            ("no-such-command",),
            "error: no such command 'no-such-command' (commands: demo, train, engine",
        ),
    ]
    for args, message in cases:
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith(message), (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
        assert "╭" not in result.stderr and "Usage:" not in result.stderr
        assert result.stdout == ""


def test_help_and_a_bare_group_keep_their_output_and_exit_codes():
    assert run_cli("eplb", "bench", "--help").returncode == 0
    bare = run_cli("eplb")  # no command: the group's help, exit 2 as click does
    assert bare.returncode == 2 and "Commands" in bare.stdout and "error" not in bare.stderr


def test_a_missing_file_from_the_library_is_one_line_without_errno():
    from moeinfra.cli.main import _error_text

    text = _error_text(FileNotFoundError(2, "No such file or directory", "x.json"))
    assert text == "x.json: no such file or directory"


# A number as the CLI prints it: `2.4 × 10⁻⁷`, or digits with optional thousands separators,
# decimals and exponent (`1,574`, `0.01163`; `1e-07` and `1574.3` are caught, not skipped).
_POWER_OF_TEN = re.compile(r"(?<![\w.])(-?\d\.\d) × 10([⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+)")
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")
_FROM_SUPERSCRIPT = str.maketrans("⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "-0123456789")


def assert_numbers_follow_the_rule(text: str) -> int:
    """Every number in ``text`` is ``format_number`` of its own value; returns how many there were."""
    from moeinfra.numfmt import format_number

    found = 0
    for m in _POWER_OF_TEN.finditer(text):
        value = float(m.group(1)) * 10.0 ** int(m.group(2).translate(_FROM_SUPERSCRIPT))
        assert format_number(value) == m.group(0), (m.group(0), format_number(value))
        found += 1
    for token in _NUMBER.findall(_POWER_OF_TEN.sub(" ", text)):
        plain = token.replace(",", "")
        value = float(plain) if any(c in plain for c in ".eE") else int(plain)
        assert format_number(value) == token, (token, format_number(value))
        found += 1
    return found


def test_the_number_checker_catches_hand_formatted_numbers():
    assert assert_numbers_follow_the_rule("1,574 ms, 0.01163, 96.32%, 2.4 × 10⁻⁷, rank 0") == 5
    for bad in ("0.1000", "1574.3", "1574", "1e-07", "2.38e-07", "100.0", "3.0 s", "0.000123"):
        with pytest.raises(AssertionError):
            assert_numbers_follow_the_rule(bad)


def _human_output(group: str, tmp_path, monkeypatch) -> str:
    """A representative command's human output (tables and summary lines) of ``group``."""
    env = dict(os.environ, COLUMNS="250")  # wide: rich folds no number across lines

    def run(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "moeinfra.cli", group, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    if group == "eplb":
        import numpy as np

        from moeinfra.eplb.published import EXAMPLE_WEIGHT

        np.save(tmp_path / "a.npy", EXAMPLE_WEIGHT)
        np.save(tmp_path / "b.npy", EXAMPLE_WEIGHT[:, ::-1])
        shape = ("--replicas", "16", "--groups", "4", "--nodes", "2", "--gpus", "8")
        a, b = str(tmp_path / "a.npz"), str(tmp_path / "b.npz")
        out = run("plan", "--load", str(tmp_path / "a.npy"), *shape, "-o", a)
        out += run("plan", "--load", str(tmp_path / "b.npy"), *shape, "--previous", a, "-o", b)
        assert "migration:" in out and " GB" in out
        return out + run("eval", "--plan", a, "--load", str(tmp_path / "b.npy"))
    if group == "trace":
        path = "examples/data/deepseek_train_trace.json"
        commands = (("report", path), ("kernels", path, "--top", "4"), ("steps", path))
        commands += (("idle", path), ("launches", path), ("queue", path), ("diff", path, path))
        return "".join(run(*args) for args in commands)
    if group == "pipeline":
        return run("simulate", "-s", "dualpipe", "-r", "8", "-m", "20", "--costs", "FB=2.5") + run(
            "compare", "--ranks", "8", "--microbatches", "32", "--costs", "F=1,B=2,W=1,FB=2.4"
        )
    # moe: the ranks' figures without starting gloo processes (timings vary; their format not)
    import importlib

    from typer.testing import CliRunner

    from moeinfra.cli.moe import app

    result = {
        "per_rank_time_s": [0.0123456, 1.5744],
        "per_rank_comm_hidden_fraction": [0.49123, None],
        "step_times_s": [0.0123456, 1.5744, 0.07],
        "step_time_s": 0.07,
        "expert_load": [[23, 1025, 1633, 2]],
        "max_abs_error_vs_reference": 2.384e-7,
        "experts_migrated": 16,
        "max_abs_error_after_rebalance": 0.0,
        "balancedness_before": 0.88581,
        "balancedness_after": 0.9985,
        "comm_hidden_fraction": 0.5492,
        "torchrun_command": "torchrun --nproc-per-node 2 examples/moe_torchrun.py",
        "trace": None,
    }
    monkeypatch.setattr(importlib.import_module("moeinfra.moe.run"), "run", lambda *a, **k: result)
    monkeypatch.setenv("COLUMNS", "250")
    out = CliRunner().invoke(app, ["run", "--tokens", "4096"])
    assert out.exit_code == 0, out.output
    assert "max 1,574" in out.stdout and "2.4 × 10⁻⁷" in out.stdout and "4,096" in out.stdout
    return out.stdout


@pytest.mark.parametrize("group", ["eplb", "moe", "pipeline", "trace"])
def test_every_number_in_human_output_follows_the_one_rule(group, tmp_path, monkeypatch):
    """Tables and summary lines print numbers as ``moeinfra.numfmt.format_number`` does (the HTML
    report's rule): no ``0.1000``, ``1574.3`` or ``1e-07``. Paths and pasteable commands are
    left out: they are not numbers for people."""
    text = _human_output(group, tmp_path, monkeypatch)
    kept = [
        line.replace(str(tmp_path), "")
        for line in text.splitlines()
        if not line.startswith(("same run under torchrun:", "plan written to"))
    ]
    assert assert_numbers_follow_the_rule("\n".join(kept)) > 10
