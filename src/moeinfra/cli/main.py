"""Entry point of the ``moeinfra`` console script.

Each capability has its own module with a ``typer.Typer`` app, registered here under its name.
Bad input becomes one line on stderr and exit code 2, never a traceback or a usage box: usage errors
(missing or extra arguments, unknown options, option values out of range) through :class:`Cli`,
``ValueError`` and ``OSError`` from the library through :func:`main`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import typer
from typer.core import TyperGroup

#: Subcommand groups: module and one-line help. Only the group being run is imported, so
#: ``moeinfra --help`` and ``moeinfra trace ...`` do not pay for numba, torch or the server.
GROUPS = {
    "engine": (
        "moeinfra.cli.engine",
        "Inference engine for DeepSeek-V3 and V3.2 checkpoints (Hugging Face format).",
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


#: The exception classes of the click typer runs on (click itself, or the copy typer >= 0.2x ships).
_ERRORS = sys.modules[typer.BadParameter.__module__]


class Cli(TyperGroup):
    """The ``moeinfra`` command: a usage error is one line on stderr and exit code 2, e.g.
    ``error: missing argument 'B' (usage: moeinfra trace diff [OPTIONS] A B)``, instead of
    click's usage box. ``--help``, a group run without a command and exit codes stay as they are.
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:  # an embedding caller handles the exceptions itself
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        no_args_help = getattr(_ERRORS, "NoArgsIsHelpError", ())
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except no_args_help:  # the help is printed already; click's exit code for it
            sys.exit(2)
        except _ERRORS.UsageError as exc:
            typer.echo(f"error: {usage_error_line(exc, argv)}", err=True)
            sys.exit(2)
        except _ERRORS.ClickException as exc:
            typer.echo(f"error: {_one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        # Non-standalone click returns typer.Exit's code, or the command's return value: commands
        # here return None.
        sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)


def usage_error_line(exc: Exception, argv: list[str]) -> str:
    """A click usage error as one line: what was wrong, naming the option and its value, and
    what the command takes (its usage for a missing or extra argument, its commands for a group)."""
    param = getattr(exc, "param", None)
    kind = getattr(param, "param_type_name", None)
    if isinstance(exc, _ERRORS.NoSuchOption):
        text = f"no such option: {exc.option_name}"
        if exc.possibilities:
            text += f" (did you mean {' or '.join(sorted(exc.possibilities))}?)"
    elif isinstance(exc, _ERRORS.MissingParameter) and kind == "argument":
        text = f"missing argument '{_metavar(param)}'"
    elif (
        isinstance(exc, _ERRORS.BadParameter)
        and not isinstance(exc, _ERRORS.MissingParameter)
        and kind == "option"
        and (given := _option_value(param, argv)) is not None
    ):
        text = f"{given[0]}={given[1]}: {_lower_first(_one_line(exc.message))}"
    else:
        text = _lower_first(_one_line(exc.format_message()))
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and hasattr(ctx.command, "list_commands"):
        text += f" (commands: {', '.join(ctx.command.list_commands(ctx))})"
    elif ctx is not None and (kind == "argument" or "extra argument" in text):
        text += f" (usage: {_usage(ctx)})"
    return text


def _metavar(param) -> str:
    return (param.metavar or param.name or "ARG").upper()


def _usage(ctx) -> str:
    """``moeinfra trace diff [OPTIONS] A B`` (click's own usage line may show ``{a} {b}``)."""
    pieces = [ctx.command_path]
    if any(p.param_type_name == "option" for p in ctx.command.params):
        pieces.append("[OPTIONS]")
    for p in ctx.command.params:
        if p.param_type_name == "argument":
            name = _metavar(p) + ("..." if p.nargs == -1 else "")
            pieces.append(name if p.required else f"[{name}]")
    return " ".join(pieces)


def _option_value(param, argv: list[str]) -> tuple[str, str] | None:
    """The option's long name and the value of its last ``--name VALUE`` / ``--name=VALUE`` /
    ``-n VALUE`` in ``argv``."""
    long = next((name for name in param.opts if name.startswith("--")), param.opts[0])
    found = None
    for i, arg in enumerate(argv):
        for name in param.opts:
            if arg == name and i + 1 < len(argv):
                found = (long, argv[i + 1])
            elif name.startswith("--") and arg.startswith(name + "="):
                found = (long, arg[len(name) + 1 :])
    return found


def _one_line(text: str) -> str:
    return " ".join(text.split()).rstrip(".")


def _lower_first(text: str) -> str:
    # "Missing argument" -> "missing argument"; "CUDA ..." and "'x' is ..." stay as they are
    return text[0].lower() + text[1:] if text[:2].istitle() else text


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
        cls=Cli,
        add_completion=False,
    )
    for name, (_, text) in GROUPS.items():
        if groups is None or name in groups:
            app.add_typer(group_app(name), name=name)
        else:
            app.add_typer(typer.Typer(help=text, no_args_is_help=True), name=name)
    from moeinfra.cli.train import train  # typer and numfmt only; torch when it runs

    app.command()(demo)
    app.command()(train)
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

    Usage errors (missing argument, unknown option, value out of range) are one line too (see
    :class:`Cli`) and exit 2.
    """
    wanted = tuple(arg for arg in sys.argv[1:2] if arg in GROUPS)
    try:
        build_app(wanted)()
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {_error_text(exc)}", err=True)
        sys.exit(2)


def _error_text(exc: Exception) -> str:
    # "[Errno 2] No such file or directory: 'x.json'" -> "x.json: no such file or directory"
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {_lower_first(exc.strerror)}"
    return _one_line(str(exc)) if "\n" in str(exc) else str(exc)


def __getattr__(name: str):
    if name == "app":  # the whole CLI, for tests and embedding (imports every group)
        return build_app()
    raise AttributeError(name)
