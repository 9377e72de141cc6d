"""What made a report, for its title block: the project version, when, on which machine, and how
long each section took to build — so a report read later, or elsewhere, says what it measured on."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from moeinfra.numfmt import format_number, percent
from moeinfra.report.page import table_html

_REPO = Path(__file__).resolve().parents[3]  # the checkout, when run from one


@dataclass(frozen=True)
class RunInfo:
    """Facts about one run; ``None`` where the machine does not say."""

    project: str
    version: str
    git: str | None
    created: datetime  # UTC
    cpu: str
    logical_cores: int | None
    usable_cores: int | None
    ram_bytes: int | None
    os: str
    python: str
    packages: dict[str, str] = field(default_factory=dict)  # name -> version, installed ones only
    load_1min: float | None = None  # runnable processes, 1-minute average, when the run started


def collect(project: str = "moeinfra") -> RunInfo:
    """Read the version, UTC time and machine description of this process (no torch import)."""
    return RunInfo(
        project=project,
        version=_version(project),
        git=_git_revision(),
        created=datetime.now(UTC),
        cpu=_cpu_model(),
        logical_cores=os.cpu_count(),
        usable_cores=_usable_cores(),
        ram_bytes=_ram_bytes(),
        os=_os_name(),
        python=f"{platform.python_implementation()} {platform.python_version()}",
        packages={
            name: version
            for name in ("torch", "numpy", "matplotlib")
            if (version := _version(name)) != "not installed"
        },
        load_1min=load_average(),
    )


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), or None where the OS does not say. Next to
    the core count it tells whether the timings of a report were taken on a busy machine."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def title_block_html(
    info: RunInfo, timings_s: Sequence[tuple[str, float]], *, load_end: float | None = None
) -> str:
    """Two tables side by side: the run (project, version, date, machine, load, software) and the
    build time of each section (``timings_s``: ``(section name, seconds)`` in report order) with
    the total. ``load_end``: the 1-minute load average when the run ended."""
    cores = (
        "unknown"
        if info.logical_cores is None
        else f"{info.logical_cores} logical"
        + (
            f", {info.usable_cores} usable by this process"
            if info.usable_cores not in (None, info.logical_cores)
            else ""
        )
    )
    about = [
        ["project", info.project],
        ["version", info.version + (f" (git {info.git})" if info.git else "")],
        ["generated", info.created.strftime("%Y-%m-%d %H:%M:%S UTC")],
        ["CPU", info.cpu],
        ["cores", cores],
        [
            "RAM",
            "unknown" if info.ram_bytes is None else f"{format_number(info.ram_bytes / 2**30)} GiB",
        ],
        *(
            [
                [
                    "load average (1 min), start / end",
                    f"{format_number(info.load_1min)} / {format_number(load_end)}",
                ]
            ]
            if info.load_1min is not None and load_end is not None
            else []
        ),
        ["OS", info.os],
        ["Python", info.python],
        *([name, version] for name, version in info.packages.items()),
    ]
    total = sum(seconds for _, seconds in timings_s)
    times = [[name, round(seconds, 1), _share(seconds, total)] for name, seconds in timings_s]
    times.append(["total", round(total, 1), "100%" if total else "-"])
    return (
        '<div class="title-block"><div class="about">'
        + table_html(["about this report", ""], about)
        + "</div><div>"
        + table_html(["section", "build time (s)", "share"], times)
        + "</div></div><p>Times and speeds measured in this report are this machine's; a load "
        "average above the number of cores means other work shared the cores while it ran.</p>"
    )


def _share(part: float, total: float) -> str:
    if not total:
        return "-"
    return "<1%" if 0 < part / total < 0.005 else percent(part / total)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_revision() -> str | None:
    """``abc1234`` or ``abc1234, uncommitted changes`` when the package runs from a git checkout."""
    if not (_REPO / ".git").exists():
        return None
    try:
        rev = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(_REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "--no-optional-locks",
                "-C",
                str(_REPO),
                "status",
                "--porcelain",
                "--untracked-files=no",
            ],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{rev}, uncommitted changes" if dirty else rev or None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown"


def _usable_cores() -> int | None:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _os_name() -> str:
    system = f"{platform.system()} {platform.release()}".strip()
    try:
        pretty = platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:
        pretty = None
    if platform.system() == "Darwin" and platform.mac_ver()[0]:
        pretty = f"macOS {platform.mac_ver()[0]}"
    return (
        f"{pretty} ({system}, {platform.machine()})"
        if pretty
        else f"{system}, {platform.machine()}"
    )
