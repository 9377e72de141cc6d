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
