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
