"""``moeinfra serve``: simulate a prefill/decode fleet, plan capacity, show the performance model.

One module per command (``simulate``, ``plan``, ``frontier``, ``model``, ``position_cost``; the
live server's commands are :mod:`moeinfra.cli.serve_live`), what they share in ``common``."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="Inference fleet: simulate a day, plan capacity, per-layer performance model.",
    no_args_is_help=True,
)

# each registers its command on app, in the order --help lists them
from moeinfra.cli.serve import simulate, plan, frontier, model, position_cost  # noqa: E402, F401, I001
