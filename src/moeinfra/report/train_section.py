"""Report section: a tiny DeepSeek-V3 with its MTP layer trained through DualPipeV, then served
with MTP speculative decoding."""

from __future__ import annotations

import tempfile
from pathlib import Path

from moeinfra.numfmt import percent
from moeinfra.report.page import Section, figure_html, table_html

_TITLE = "Training with MTP through DualPipeV, then drafting with it"
_STEPS = 300
_PROMPTS = [
    "Expert parallelism spreads the experts",
    "The prefill unit computes the KV cache",
    "DualPipe overlaps the forward and backward",
    "The decode unit runs",
]


def build(out_dir: Path) -> Section:
    """Train (DualPipeV, 2 gloo ranks, :data:`_STEPS` steps), plot the loss, and measure the
    engine's draft acceptance with 1-3 drafts; writes ``train_loss.png`` into ``out_dir``."""
    try:
        import torch  # noqa: F401

        from moeinfra.engine import LLM, SamplingParams
        from moeinfra.train import TrainConfig, train
    except ImportError:
        return Section("train", _TITLE, "<p>This section needs pip install moeinfra[engine].</p>")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path, losses = train(Path(tmp) / "trained", TrainConfig(steps=_STEPS))
        greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        rows, sample = [], None
        for k in (1, 2, 3):
            with LLM(
                path, speculative_config={"method": "mtp", "num_speculative_tokens": k}
            ) as llm:
                outputs = llm.generate(_PROMPTS, greedy, use_tqdm=False)
                stats = llm._core.spec_stats
            per_position = stats.per_position / max(stats.num_drafts, 1)
            rows.append(
                [k, *[percent(p) for p in per_position], *["—"] * (3 - k),
                 stats.mean_acceptance_length]
            )  # fmt: skip
            sample = sample or outputs[0]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (main + 0.3 MTP cross-entropy)")
    ax.set_title("tiny DeepSeek-V3 + MTP, DualPipeV on 2 gloo ranks")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    figure = out_dir / "train_loss.png"
    fig.savefig(figure, dpi=120)
    plt.close(fig)
    body = (
        "<p><code>moeinfra train</code>: the tiny DeepSeek-V3 (1 dense and 2 MoE layers) with one "
        "MTP layer, trained on the text the project ships with DeepSeek-V3's objective (next-token "
        "cross-entropy plus 0.3 times the MTP layer's on the token after next) through moeinfra's "
        "DualPipeV on 2 gloo ranks, expert balance by DeepSeek's auxiliary-loss-free bias "
        f"updates; {_STEPS} steps of 16 sequences of 64 tokens. The checkpoint it writes is "
        "DeepSeek's layout; the engine serves it and drafts with its MTP layer.</p>"
        + figure_html(figure.name, "Training loss per step")
        + table_html(
            ["drafts per step", "accepted at 1", "at 2", "at 3", "mean acceptance length"], rows
        )
        + f"<p>Greedy: <code>{sample.prompt}</code> → <code>{sample.outputs[0].text!r}</code></p>"
    )
    return Section("train", _TITLE, body)
