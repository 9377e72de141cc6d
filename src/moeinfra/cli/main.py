"""Entry point of the ``moeinfra`` console script.

Each capability has its own module with a ``typer.Typer`` app, registered here under its name.
Bad input (``ValueError`` and ``OSError`` from the library) becomes one line on stderr and exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from moeinfra.cli import engine as engine_cli
from moeinfra.cli import eplb as eplb_cli
from moeinfra.cli import moe as moe_cli
from moeinfra.cli import pipeline as pipeline_cli
from moeinfra.cli import serve as serve_cli
from moeinfra.cli import serve_live
from moeinfra.cli import trace as trace_cli

app = typer.Typer(
    name="moeinfra",
    help="DeepSeek-style MoE infrastructure: EPLB, pipeline schedules, trace overlap analysis, inference engine, serving.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(engine_cli.app, name="engine")
app.add_typer(eplb_cli.app, name="eplb")
app.add_typer(moe_cli.app, name="moe")
app.add_typer(pipeline_cli.app, name="pipeline")
serve_live.register(serve_cli.app)
app.add_typer(serve_cli.app, name="serve")
app.add_typer(trace_cli.app, name="trace")


@app.command()
def demo(
    out: Path = typer.Option(
        Path("report"), "--out", "-o", help="Folder for index.html and figures."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Run every capability on built-in defaults and write an HTML report with figures."""
    from moeinfra.report.demo import build_demo_report

    index = build_demo_report(out, quiet=quiet)
    typer.echo(f"report written to {index}")


def main() -> None:
    """Run the CLI; turn bad-input errors from the library into one line and exit code 2.

    Usage errors (unknown option, bad type) are typer's own and also exit 2.
    """
    try:
        app()
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
