"""The demo report: the EPLB section builds its figures and table, and the page links them."""

import re

from moeinfra.report.eplb_section import build
from moeinfra.report.page import write_report


def test_eplb_section_and_page(tmp_path):
    section = build(tmp_path)
    for name in re.findall(r'src="([^"]+)"', section.body_html):
        assert (tmp_path / name).stat().st_size > 0
    # the published example row reads "True" for both layers
    assert section.body_html.count("<td>True</td>") == 2
    page = write_report(tmp_path, "report", [section])
    text = page.read_text()
    assert 'href="#eplb"' in text and section.body_html in text


def test_engine_section_chats_and_plots(tmp_path, monkeypatch):
    from PIL import Image

    from moeinfra.report import engine_section

    monkeypatch.setenv("MOEINFRA_CACHE", str(tmp_path / "cache"))
    section = engine_section.build(tmp_path)
    png = tmp_path / "engine_decode.png"
    assert png.stat().st_size > 0
    # a real plot: more than one colour in the picture
    assert len(Image.open(png).convert("RGB").getcolors(maxcolors=1 << 16) or []) > 10
    rows = re.findall(r"<tr><td>", section.body_html)
    assert len(rows) == len(engine_section._PROMPTS) + len(engine_section._BATCHES)
    assert section.body_html.count("<td>length</td>") + section.body_html.count(
        "<td>stop</td>"
    ) == len(engine_section._PROMPTS)


def test_moe_section_reports_medians_with_spread_and_a_drawn_timeline(tmp_path):
    from PIL import Image

    from moeinfra.report import moe_section

    section = moe_section.build(tmp_path)
    rows = re.findall(
        r"<tr><td>([\d.]+)</td><td>(none|prefill)</td><td>([\d.]+)</td>"
        r"<td>([\d.]+)-([\d.]+)</td><td>([^<]*)</td></tr>",
        section.body_html,
    )
    assert [(r[0], r[1]) for r in rows] == [
        ("0", "none"),
        ("0", "prefill"),
        ("4", "none"),
        ("4", "prefill"),
    ]
    for _, _, median, q1, q3, _ in rows:
        assert float(q1) <= float(median) <= float(q3)
    assert rows[3][5].endswith("%") and all(r[5] == "-" for r in rows[:3])
    assert re.search(r"<td>\d+%</td>", section.body_html)  # communication hidden, traced run
    png = Image.open(tmp_path / "moe_timeline.png").convert("RGB")
    assert len(png.getcolors(maxcolors=1 << 16) or []) > 10
