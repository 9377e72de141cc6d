"""``moeinfra eplb ...`` (being written)."""

import typer

app = typer.Typer(help="Expert-parallelism load balancer: plan, evaluate, show, benchmark.", no_args_is_help=True)


@app.command()
def bench() -> None:
    """Time the policies (being written)."""
