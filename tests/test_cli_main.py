import re
import subprocess
import sys


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
        (("no-such-command",), "error: no such command 'no-such-command' (commands: demo, engine"),
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
