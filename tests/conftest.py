"""Suite-wide pytest hooks."""

from __future__ import annotations


def pytest_collection_modifyitems(items):
    """The docs blocks (one module, about a third of the suite's time) run first: under
    ``make test``'s two xdist workers a module stays on one worker, and a long module handed out
    last would leave the other worker idle while it runs."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] != "tests/test_docs.py")
