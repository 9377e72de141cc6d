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
