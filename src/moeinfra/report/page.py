"""A report is a list of sections; each section is HTML plus the figure files it references.

Section builders live one per capability (``report/eplb_section.py``, ...). Each takes the output folder,
writes its figures there, and returns a :class:`Section`. :func:`write_report` writes ``index.html``
atomically.

Numbers in tables go through :func:`moeinfra.numfmt.format_number`, one rule for the whole report
(no scientific notation a reader has to decode; see there). Units belong in the column header or the
row label, not in the cell.
"""

from __future__ import annotations

import html
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moeinfra.atomicio import write_text_atomic
from moeinfra.numfmt import format_number


@dataclass(frozen=True)
class Section:
    """One part of the report: an anchor id, a title and an HTML body (figures as relative paths)."""

    anchor: str
    title: str
    body_html: str


def _cell(value: object) -> str:
    if isinstance(value, numbers.Real):  # bool, int, float and numpy scalars
        return html.escape(format_number(value))
    return html.escape(str(value))


def table_html(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML table; cells are escaped, numbers printed by :func:`format_number`."""
    head = "".join(f"<th>{_cell(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def figure_html(file_name: str, caption: str) -> str:
    """An <img> with a caption; ``file_name`` is relative to the report folder."""
    return (
        f'<figure><img src="{html.escape(file_name)}" alt="{html.escape(caption)}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { border-bottom: 2px solid #444; } h2 { margin-top: 2em; border-bottom: 1px solid #aaa; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
td { white-space: nowrap; } /* a value or a formula stays on one line; headers wrap */
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1em 0; } img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.85em; color: #555; } code { background: #f4f4f4; padding: 0 0.2em; }
.title-block { display: flex; flex-wrap: wrap; gap: 0 2em; align-items: flex-start; }
.title-block .about td { text-align: left; }
"""


def write_report(
    out_dir: Path, title: str, sections: Sequence[Section], *, title_block: str = ""
) -> Path:
    """Write ``out_dir/index.html``: the title, ``title_block`` (HTML placed under it, e.g. what
    :func:`moeinfra.report.run_info.title_block_html` makes), a table of contents and the sections;
    return its path."""
    toc = "".join(f'<li><a href="#{s.anchor}">{html.escape(s.title)}</a></li>' for s in sections)
    parts = "".join(
        f'<section id="{s.anchor}"><h2>{html.escape(s.title)}</h2>{s.body_html}</section>'
        for s in sections
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{title_block}<ul>{toc}</ul>{parts}</body></html>"
    )
    index = out_dir / "index.html"
    write_text_atomic(index, page)
    return index
