"""``moeinfra engine``: write the built-in tiny checkpoint; generate from a DeepSeek-V3 checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(
    help="Inference engine for DeepSeek-V3 and V3.2 checkpoints (Hugging Face format).",
    no_args_is_help=True,
)


@app.command("init-tiny")
def init_tiny_cmd(
    path: Path = typer.Argument(..., help="New folder for the checkpoint."),
    tokenizer: str = typer.Option(
        "deepseek-v3",
        "--tokenizer",
        help="deepseek-v3 (DeepSeek-V3's own) or bpe (small, trained).",
    ),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    fp8: bool = typer.Option(False, "--fp8", help="Store projections as FP8 128x128 blocks."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    shards: int = typer.Option(
        2, "--shards", help="Safetensors files; 1 writes one model.safetensors with no index."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="KEY=VALUE of config.json to change, e.g. hidden_size=256 (repeatable)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing folder."),
    arch: str = typer.Option(
        "deepseek_v3",
        "--arch",
        help="deepseek_v3, deepseek_v32 (DeepSeek-V3.2: sparse attention, index_topk 16) or "
        "deepseek_v4 (DeepSeek-V4: sliding-window and compressed attention, mHC, hash routing).",
    ),
) -> None:
    """Write a small DeepSeek-V3-shaped checkpoint (random weights) in Hugging Face's format."""
    from moeinfra.engine.tiny import init_tiny

    out = init_tiny(
        path,
        tokenizer=tokenizer,
        dtype=dtype,
        fp8=fp8,
        seed=seed,
        shards=shards,
        overwrite=overwrite,
        config=_config_overrides(overrides),
        arch=arch,
    )
    name = {
        "deepseek_v3": "DeepSeek-V3",
        "deepseek_v32": "DeepSeek-V3.2",
        "deepseek_v4": "DeepSeek-V4",
    }[arch]
    typer.echo(f"tiny {name} checkpoint written to {out}")


def _config_overrides(items: list[str]) -> dict:
    """``KEY=VALUE`` strings -> config values (JSON numbers and booleans, else strings)."""
    from moeinfra.errors import InputError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--set {item!r} must be KEY=VALUE, e.g. hidden_size=256")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


@app.command()
def generate(
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="Prompt (repeat for a batch)."),
    model: Path | None = typer.Option(
        None, "--model", "-m", help="Checkpoint folder (default: the built-in tiny one)."
    ),
    ranks: int = typer.Option(1, "--ranks", help="Ranks of the unit (EP degree)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user chat message."),
    max_tokens: int = typer.Option(32, "--max-tokens", help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: int | None = typer.Option(None, "--seed", help="Per-request sampling seed."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    redundant_experts: int = typer.Option(0, "--redundant-experts"),
    overlap: str = typer.Option("auto", "--overlap", help="auto, none, prefill or decode."),
    dtype: str = typer.Option(
        "auto", "--dtype", help="auto (bfloat16 on a GPU, float32 on the CPU), float32, ..."
    ),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    speculative_tokens: int = typer.Option(
        0,
        "--speculative-tokens",
        help="Draft tokens per step from the checkpoint's MTP layer (0 = no speculative decoding).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print results as JSON lines."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Generate a completion for each prompt."""
    from moeinfra.cli.options import input_folder
    from moeinfra.engine.config import EngineConfig
    from moeinfra.engine.params import SamplingParams
    from moeinfra.errors import InputError

    # Options first: a typo fails at once, before torch and the model load.
    if model is not None:
        input_folder(model, "--model")
    if ranks < 1:
        raise InputError(f"--ranks={ranks} must be a positive integer")
    options = dict(
        redundant_experts=redundant_experts,
        overlap=overlap,
        dtype=dtype,
        device=device,
        num_speculative_tokens=speculative_tokens,
    )
    try:
        EngineConfig(**options)
    except InputError as exc:
        raise InputError(
            str(exc).replace("num_speculative_tokens=", "--speculative-tokens=")
        ) from None
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        stop=stop or None,
        seed=seed,
        ignore_eos=ignore_eos,
    )
    from moeinfra.engine import LLM

    with LLM(model, ranks=ranks, **options) as llm:
        if chat:
            messages = [[{"role": "user", "content": p}] for p in prompt]
            results = llm.chat(messages, params, use_tqdm=not quiet)
        else:
            results = llm.generate(prompt, params, use_tqdm=not quiet)
    for r in results:
        out = r.outputs[0]
        if as_json:
            record = {
                "prompt": r.prompt,
                "prompt_token_ids": r.prompt_token_ids,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "num_cached_tokens": r.num_cached_tokens,
                "num_draft_tokens": r.num_draft_tokens,
                "num_accepted_tokens": r.num_accepted_tokens,
            }
            typer.echo(json.dumps(record, ensure_ascii=False))
        else:
            typer.echo(f"{r.prompt!r} -> {out.text!r} ({out.finish_reason})")
