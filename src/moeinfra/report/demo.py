"""``make demo``: every capability on built-in defaults, one HTML report."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from moeinfra.report import (
    arch_section,
    engine_section,
    eplb_section,
    moe_section,
    pipeline_section,
    run_info,
    server_section,
    serving_section,
    trace_section,
    train_section,
)
from moeinfra.report.page import Section, write_report

SectionBuilder = Callable[[Path], Section]

# One builder per capability, in report order. Each writes its figures into the folder it is given.
SECTION_BUILDERS: list[tuple[str, SectionBuilder]] = [
    ("EPLB", eplb_section.build),
    ("Pipeline", pipeline_section.build),
    ("Trace", trace_section.build),
    ("MoE", moe_section.build),
    ("Training", train_section.build),
    ("Engine", engine_section.build),
    ("Architectures", arch_section.build),
    ("Serving", serving_section.build),
    ("Server", server_section.build),
]


def build_demo_report(
    out_dir: Path,
    *,
    quiet: bool = False,
    builders: list[tuple[str, SectionBuilder]] | None = None,
) -> Path:
    """Build every section (``builders``, default :data:`SECTION_BUILDERS`) into ``out_dir``, timing
    each, and write ``out_dir/index.html`` under a title block (version, date, machine, build times);
    return its path."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    info = run_info.collect()  # the date is the run's start
    sections, timings_s = [], []
    for name, builder in tqdm(
        builders or SECTION_BUILDERS, desc="report", disable=quiet or None, unit="section"
    ):
        if not quiet:
            tqdm.write(f"building {name} section")
        start = time.perf_counter()
        sections.append(builder(out_dir))
        timings_s.append((name, time.perf_counter() - start))
    return write_report(
        out_dir,
        "moeinfra demo report",
        sections,
        title_block=run_info.title_block_html(info, timings_s, load_end=run_info.load_average()),
    )
