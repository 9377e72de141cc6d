"""``moeinfra train``: train the tiny DeepSeek-V3 with its MTP layer through DualPipeV, write the
checkpoint."""

from __future__ import annotations

from pathlib import Path

import typer

from moeinfra.numfmt import format_number


def train(
    path: Path = typer.Argument(..., help="New folder for the trained checkpoint."),
    steps: int = typer.Option(300, "--steps", help="Optimiser steps."),
    ranks: int = typer.Option(
        2, "--ranks", help="DualPipeV ranks (gloo processes; 1 = one process, no pipeline)."
    ),
    seq_len: int = typer.Option(64, "--seq-len", help="Tokens per training sequence."),
    micro_batch: int = typer.Option(4, "--micro-batch", help="Sequences per micro-batch."),
    num_chunks: int = typer.Option(
        4, "--num-chunks", help="Micro-batches per step (DualPipeV: >= 2 x ranks)."
    ),
    lr: float = typer.Option(3e-3, "--lr", help="Peak learning rate (AdamW, cosine decay)."),
    mtp_weight: float = typer.Option(
        0.3, "--mtp-weight", help="Weight of the MTP loss (DeepSeek-V3's lambda)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights and the data order."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing folder."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Train a tiny DeepSeek-V3 with its MTP layer on the text the project ships (DualPipeV over
    gloo ranks) and write it as a checkpoint in DeepSeek's layout."""
    import sys

    from tqdm import tqdm

    from moeinfra.errors import InputError
    from moeinfra.train import TrainConfig
    from moeinfra.train import train as run

    options = dict(
        steps=steps,
        ranks=ranks,
        seq_len=seq_len,
        micro_batch=micro_batch,
        num_chunks=num_chunks,
        lr=lr,
        mtp_weight=mtp_weight,
        seed=seed,
    )
    try:
        config = TrainConfig(**options)
    except InputError as exc:  # name the options as typed
        text = str(exc)
        for name in options:
            text = text.replace(f"{name}=", f"--{name.replace('_', '-')}=")
        raise InputError(text) from None
    bar = tqdm(total=steps, desc="train", unit="step", disable=quiet or not sys.stderr.isatty())

    def progress(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=format_number(loss))

    try:
        out, losses = run(path, config, overwrite=overwrite, progress=progress)
    finally:
        bar.close()
    typer.echo(
        f"loss {format_number(losses[0])} -> {format_number(losses[-1])} over "
        f"{format_number(steps)} steps; checkpoint written to {out}"
    )
