"""EPLB section of the demo report (being written)."""

from pathlib import Path

from moeinfra.report.page import Section


def build(out_dir: Path) -> Section:
    return Section("eplb", "Expert-parallelism load balancer", "<p>being written</p>")
