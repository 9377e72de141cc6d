"""The torch.distributed runtime on gloo: losses bitwise equal and gradients equal to one process."""

import subprocess
import sys

import pytest

pytest.importorskip("torch")

from .dist_checks import CHECKS, run_checks  # noqa: E402


def _assert_all_pass(results):
    failures = {name: errs for name, errs in results.items() if errs}
    assert not failures, "\n".join(f"{n}: {e}" for n, errs in failures.items() for e in errs)


@pytest.mark.timeout(120)
def test_two_ranks_all_checks():
    _assert_all_pass(run_checks(2, list(CHECKS), timeout_s=90))


@pytest.mark.timeout(120)
def test_four_ranks_all_checks():
    _assert_all_pass(run_checks(4, list(CHECKS), timeout_s=100))


@pytest.mark.timeout(180)
def test_eight_ranks_dualpipe():
    checks = ["dualpipe", "deepseek_script_dualpipe", "deepseek_script_dualpipev"]
    _assert_all_pass(run_checks(8, checks, timeout_s=160))


def test_schedules_do_not_import_torch():
    code = (
        "import sys, moeinfra.pipeline as p, moeinfra.pipeline.timeline;"
        "p.simulate(p.dualpipe(4, 8)); assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_importing_deepseek_names_keeps_the_dualpipe_generator_callable():
    code = (
        "from moeinfra.pipeline.dualpipe import DualPipe;"
        "from moeinfra.pipeline import dualpipe;"
        "from moeinfra.pipeline.generators import dualpipe as gen;"
        "assert dualpipe(4, 8).actions == gen(4, 8).actions"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
