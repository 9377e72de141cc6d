"""Every fenced ``python`` and ``bash`` block of README.md and docs/*.md runs as written.

Blocks of one file run in order, in a fresh folder holding a link to the repository's ``examples/``
(so ``examples/data/...`` resolves and files a block writes are there for the next block), with this
environment's ``moeinfra`` and ``python`` first on ``PATH``, as after ``. .venv/bin/activate``. Each
python block is its own process: snippets are self-contained. A block is left out only when the line
before it says why::

    <!-- docs-test: skip (starts a server that runs until Ctrl-C) -->

``<!-- docs-test: background http://127.0.0.1:8000/health -->`` starts a bash block in the background,
waits until that URL answers, and stops it (SIGTERM) when the file's last block has run;
``<!-- docs-test: exit 2 -->`` says the block shows an error: it must exit with that code and print one
line on stderr; ``<!-- docs-test: file moe_ep.py -->`` writes the block to that file (a script the next
block runs, e.g. under ``torchrun``) instead of running it. Other fences (``text`` for output, none)
are not run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!-- docs-test: (skip \(.+\)|background \S+|exit \d+|file \S+) -->$")
BLOCK_TIMEOUT_S = 240


@dataclass
class Block:
    file: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mark: str | None

    def __str__(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(prev)
        if prev.startswith("<!-- docs-test") and not mark:
            raise AssertionError(f"{path}:{start + 1}: malformed marker {prev!r}")
        if lang in ("python", "bash"):
            found.append(
                Block(
                    path, start + 1, lang, "\n".join(lines[start + 1 : end]), mark and mark.group(1)
                )
            )
        i = end + 1
    return found


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["MPLBACKEND"] = "Agg"
    return env


def _wait_for(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"background block exited with {proc.returncode} before {url} answered"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run_as_written(path, tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env, background = _env(), []
    try:
        for block in blocks(path):
            if block.mark and block.mark.startswith("skip"):
                continue
            if block.mark and block.mark.startswith("file"):
                (tmp_path / block.mark.split()[1]).write_text(block.code + "\n")
                continue
            argv = (
                ["bash", "-euo", "pipefail", "-c", block.code]
                if block.lang == "bash"
                else [sys.executable, "-c", block.code]
            )
            if block.mark and block.mark.startswith("background"):
                proc = subprocess.Popen(
                    argv,
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
                background.append(proc)
                _wait_for(block.mark.split()[1], proc)
                continue
            started = time.monotonic()
            try:
                done = subprocess.run(
                    argv,
                    cwd=tmp_path,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=BLOCK_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired:
                pytest.fail(f"{block}: still running after {BLOCK_TIMEOUT_S} s")
            print(f"{block}: {time.monotonic() - started:.1f} s")  # shown with pytest -s
            expected = int(block.mark.split()[1]) if block.mark else 0
            assert done.returncode == expected, (
                f"{block} ({block.lang}) exited with {done.returncode}, not {expected}\n"
                f"--- block ---\n{block.code}\n--- stderr ---\n{done.stderr[-3000:]}"
            )
            if expected:
                assert len(done.stderr.strip().splitlines()) == 1, f"{block}: {done.stderr}"
    finally:
        for proc in background:
            _stop(proc)


def test_every_marker_gives_a_reason_and_precedes_a_block():
    for path in FILES:
        for block in blocks(path):
            if block.mark and block.mark.startswith("skip"):
                assert len(block.mark) > len("skip (...)"), f"{block}: say why it is skipped"


@pytest.mark.timeout(300)
def test_site_builds_strict(tmp_path):
    """``make docs``: mkdocs with Material and the mkdocstrings API reference, warnings are errors."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env={**_env(), "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").exists()
    assert "rebalance_experts" in (tmp_path / "site" / "api" / "index.html").read_text()
