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
