"""Report section: the inference engine on the built-in tiny DeepSeek-V3 checkpoint."""

from __future__ import annotations

import statistics
from pathlib import Path

from moeinfra.report.page import Section, figure_html, table_html

_TITLE = "Inference engine: the tiny DeepSeek-V3 checkpoint, prompt to tokens"
_PROMPTS = ["Hello! Who are you?", "Explain expert parallelism in one sentence."]
_BATCHES = (1, 8, 32, 128)


def _decode_speed(llm, batches) -> list[tuple[int, float, float]]:
    """``(batch, decode tokens/s, median step ms)`` from the engine's own step timings."""
    from moeinfra.engine import SamplingParams

    rows = []
    for batch in batches:
        llm._core.stats.clear()
        prompts = [[0, *range(1000 + 3 * i, 1016 + 3 * i)] for i in range(batch)]
        llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )
        steps = [s for s in llm._core.stats if s.prefill_tokens == 0]
        speed = sum(s.decode_tokens for s in steps) / sum(s.total_s for s in steps)
        rows.append((batch, speed, statistics.median(s.total_s for s in steps) * 1e3))
    return rows


def build(out_dir: Path) -> Section:
    """Chat on a 2-rank unit (redundant experts, live rebalancing) and decode speed vs batch on one
    rank; writes ``engine_decode.png`` into ``out_dir``."""
    try:
        import torch  # noqa: F401

        from moeinfra.engine import LLM, SamplingParams, default_model
    except ImportError:
        return Section("engine", _TITLE, "<p>This section needs pip install moeinfra[engine].</p>")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    from moeinfra.numfmt import format_number

    out_dir.mkdir(parents=True, exist_ok=True)
    model = default_model()
    params = SamplingParams(temperature=0, max_tokens=16)
    with LLM(model, ranks=2, redundant_experts=2, eplb_interval=4) as llm:
        conversations = [[{"role": "user", "content": p}] for p in _PROMPTS]
        chats = llm.chat(conversations, params, use_tqdm=False)
    chat_rows = [
        [p, c.outputs[0].text, len(c.outputs[0].token_ids), c.outputs[0].finish_reason]
        for p, c in zip(_PROMPTS, chats, strict=True)
    ]
    with LLM(model, enable_prefix_caching=False) as llm:
        speed = _decode_speed(llm, _BATCHES)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot([b for b, _, _ in speed], [s for _, s, _ in speed], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks(_BATCHES, [str(b) for b in _BATCHES])  # the batches measured, not powers of 2
    ax.minorticks_off()
    ax.set_ylim(0, max(s for _, s, _ in speed) * 1.1)
    ax.set_xlabel("running requests (decode batch, log scale)")
    ax.set_ylabel("output tokens/s")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_number(v)))
    ax.set_title("tiny DeepSeek-V3, 1 rank, float32, 2-core CPU")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "engine_decode.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    body = (
        f"<p>The built-in checkpoint (<code>{model}</code>): DeepSeek-V3's architecture at laptop "
        "size with random weights and DeepSeek-V3's own tokenizer and chat template, so the text is "
        "noise but every token took the path a DeepSeek-V3 token takes — chat template, MLA over a "
        "paged latent cache, group-limited routing, experts on 2 gloo ranks with 2 redundant slots "
        "placed by EPLB and re-placed every 4 steps.</p>"
        + table_html(["prompt", "completion (greedy)", "tokens", "finish"], chat_rows)
        + table_html(
            ["running requests", "decode tokens/s", "decode step (ms)"],
            [[b, round(s), round(ms, 1)] for b, s, ms in speed],
        )
        + figure_html(path.name, "Decode throughput against batch size (continuous batching)")
    )
    return Section("engine", _TITLE, body)
