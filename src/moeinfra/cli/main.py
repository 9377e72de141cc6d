"""Entry point of the ``moeinfra`` console script.

Each capability has its own module with a ``typer.Typer`` app, registered here under its name.
Bad input (``ValueError`` and ``OSError`` from the library) becomes one line on stderr and exit 2.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import typer

#: Subcommand groups: module and one-line help. Only the group being run is imported, so
#: ``moeinfra --help`` and ``moeinfra trace ...`` do not pay for numba, torch or the server.
GROUPS = {
    "engine": (
        "moeinfra.cli.engine",
        "Inference engine for DeepSeek-V3-architecture checkpoints (Hugging Face format).",
    ),
    "eplb": (
        "moeinfra.cli.eplb",
        "Expert-parallelism load balancer: plan, evaluate, show, benchmark.",
    ),
    "moe": (
        "moeinfra.cli.moe",
        "Expert-parallel DeepSeek-V3 MoE with redundant experts and dual micro-batch overlap.",
    ),
    "pipeline": (
        "moeinfra.cli.pipeline",
        "Pipeline schedules (GPipe, 1F1B, ZB1P, DualPipe, DualPipeV): simulate, compare.",
    ),
    "serve": (
        "moeinfra.cli.serve",
        "Inference fleet: simulate a day, plan capacity, per-layer performance model.",
    ),
    "trace": (
        "moeinfra.cli.trace",
        "PyTorch-profiler trace analysis: how much communication is hidden behind computation.",
    ),
}


def group_app(name: str) -> typer.Typer:
    """The ``typer`` app of subcommand group ``name`` (imports its module)."""
    sub = importlib.import_module(GROUPS[name][0]).app
    if name == "serve":
        from moeinfra.cli import serve_live

        if not any(c.callback.__name__ == "up" for c in sub.registered_commands):
            serve_live.register(sub)
    return sub


def build_app(groups: tuple[str, ...] | None = None) -> typer.Typer:
    """The CLI with ``groups`` (default: all) loaded; the others are listed by name and help
    only, enough for ``moeinfra --help``."""
    app = typer.Typer(
        name="moeinfra",
        help="DeepSeek-style MoE infrastructure: EPLB, pipeline schedules, trace overlap analysis, "
        "inference engine, serving.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )
    for name, (_, text) in GROUPS.items():
        if groups is None or name in groups:
            app.add_typer(group_app(name), name=name)
        else:
            app.add_typer(typer.Typer(help=text, no_args_is_help=True), name=name)
    app.command()(demo)
    return app


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
    wanted = tuple(arg for arg in sys.argv[1:2] if arg in GROUPS)
    try:
        build_app(wanted)()
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


def __getattr__(name: str):
    if name == "app":  # the whole CLI, for tests and embedding (imports every group)
        return build_app()
    raise AttributeError(name)
