"""Bad input to the serving commands: one line naming the argument, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["serve", "bench", "--url", "http://127.0.0.1:9", "-n", "2", "-q"], "--url="),
        (["serve", "bench", "--url", "http://127.0.0.1:9", "--rate", "0"], "--rate=0"),
        (["serve", "unit", "--server", "bogus", "--role", "decode"], "--server='bogus'"),
        (["serve", "unit", "--server", "tcp://h:1", "--role", "judge"], "--role='judge'"),
        (["serve", "up", "--prefill-units", "-1"], "--prefill-units=-1"),
        (["serve", "up", "--decode-units", "0"], "--prefill-units=1 needs --decode-units"),
        (["serve", "up", "--unit-timeout", "0.5"], "--unit-timeout=0.5"),
        (["serve", "up", "--drain-timeout", "-1"], "--drain-timeout=-1.0"),
        (["serve", "calibrate"], "exactly one of --url"),
        (
            ["serve", "calibrate", "--url", "http://x", "--measurements", "m"],
            "exactly one of --url",
        ),
        (["serve", "calibrate", "--url", "http://127.0.0.1:9"], "--url="),
        (["serve", "calibrate", "--measurements", "missing.json"], "--measurements="),
        (["serve", "model", "--calibration", "missing.json"], "--calibration='missing.json'"),
        (["serve", "simulate", "--calibration", "none", "--tick", "0s"], "--tick='0s'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, names):
    r = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in r.stderr
