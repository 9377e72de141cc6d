"""``make demo``: every capability on built-in defaults, one HTML report."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from moeinfra.report import (
    engine_section,
    eplb_section,
    moe_section,
    pipeline_section,
    server_section,
    serving_section,
    trace_section,
)
from moeinfra.report.page import Section, write_report

SectionBuilder = Callable[[Path], Section]

# One builder per capability, in report order. Each writes its figures into the folder it is given.
SECTION_BUILDERS: list[tuple[str, SectionBuilder]] = [
    ("EPLB", eplb_section.build),
    ("Pipeline", pipeline_section.build),
    ("Trace", trace_section.build),
    ("MoE", moe_section.build),
    ("Engine", engine_section.build),
    ("Serving", serving_section.build),
    ("Server", server_section.build),
]


def build_demo_report(out_dir: Path, *, quiet: bool = False) -> Path:
    """Build every section into ``out_dir`` and write ``out_dir/index.html``; return its path."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for name, builder in tqdm(
        SECTION_BUILDERS, desc="report", disable=quiet or None, unit="section"
    ):
        if not quiet:
            tqdm.write(f"building {name} section")
        sections.append(builder(out_dir))
    return write_report(out_dir, "moeinfra demo report", sections)
