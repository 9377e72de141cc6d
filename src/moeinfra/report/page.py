"""A report is a list of sections; each section is HTML plus the figure files it references.

Section builders live one per capability (``report/eplb_section.py``, ...). Each takes the output folder,
writes its figures there, and returns a :class:`Section`. :func:`write_report` writes ``index.html``
atomically.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moeinfra.atomicio import write_text_atomic


@dataclass(frozen=True)
class Section:
    """One part of the report: an anchor id, a title and an HTML body (figures as relative paths)."""

    anchor: str
    title: str
    body_html: str


def table_html(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML table; cells are escaped, floats printed with 4 significant digits."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return html.escape(f"{value:.4g}")
        return html.escape(str(value))

    head = "".join(f"<th>{cell(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
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
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1em 0; } img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.85em; color: #555; } code { background: #f4f4f4; padding: 0 0.2em; }
"""


def write_report(out_dir: Path, title: str, sections: Sequence[Section]) -> Path:
    """Write ``out_dir/index.html`` with a table of contents and the given sections; return its path."""
    toc = "".join(f'<li><a href="#{s.anchor}">{html.escape(s.title)}</a></li>' for s in sections)
    parts = "".join(
        f'<section id="{s.anchor}"><h2>{html.escape(s.title)}</h2>{s.body_html}</section>'
        for s in sections
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1><ul>{toc}</ul>{parts}</body></html>"
    )
    index = out_dir / "index.html"
    write_text_atomic(index, page)
    return index
