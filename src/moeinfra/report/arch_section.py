"""Architectures section of the demo report: what DeepSeek-V3, V3.2, V4-Flash and V4-Pro cost per
token, from their published configs, against the DeepSeek-V4 model card."""

from __future__ import annotations

from pathlib import Path

from moeinfra.numfmt import percent
from moeinfra.report.page import Section, figure_html, table_html
from moeinfra.serving.arch import CSA, HCA, MLA, SLIDING, SPARSE_MLA, published
from moeinfra.serving.arch_figures import CARD_1M, CARD_CONTEXT, MODELS, plot_per_token

_SHORT = 131_072
_KIND = {MLA: "MLA", SPARSE_MLA: "sparse MLA", SLIDING: "window only", CSA: "CSA", HCA: "HCA"}


def _share(model: float, card: float | None) -> str:
    return percent(model) if card is None else f"{percent(model)} / {percent(card)}"


def build(out_dir: Path) -> Section:
    """Write the per-token cost figure into ``out_dir`` and return the section."""
    plot_per_token(out_dir / "arch_per_token.png")
    v32 = published("deepseek-v3.2")
    v32_flops = v32.decode_flops(CARD_CONTEXT).equivalent_fp8
    v32_kv = v32.kv_bytes(CARD_CONTEXT, "fp8")
    rows = []
    for name in MODELS:
        a = published(name)
        params = a.params()
        card_flops, card_kv = CARD_1M.get(name, (None, None))
        kinds = ", ".join(f"{n} {_KIND[k]}" for k, n in a.layer_counts().items())
        rows.append(
            [
                name,
                kinds,
                params.total / 1e9,
                params.activated / 1e9,
                a.kv_bytes_per_token(_SHORT, "fp8") / 1e3,
                a.kv_bytes_per_token(CARD_CONTEXT, "fp8") / 1e3,
                a.decode_flops(_SHORT).equivalent_fp8 / 1e9,
                a.decode_flops(CARD_CONTEXT).equivalent_fp8 / 1e9,
                _share(a.decode_flops(CARD_CONTEXT).equivalent_fp8 / v32_flops, card_flops),
                _share(a.kv_bytes(CARD_CONTEXT, "fp8") / v32_kv, card_kv),
            ]
        )
    header = [
        "model",
        "layers",
        "parameters (billions)",
        "activated (billions)",
        "KV at 128K (KB per token)",
        "KV at 1M (KB per token)",
        "GFLOPs per token at 128K",
        "GFLOPs per token at 1M",
        "1M FLOPs vs V3.2 (counted / card)",
        "1M KV vs V3.2 (counted / card)",
    ]
    parts = [
        "<p>Parameters, KV cache and the FLOPs of one decoded token, counted from DeepSeek's "
        "published <code>config.json</code> of each model (<code>moeinfra.serving.arch</code>). "
        "V3 attends to every earlier token; V3.2 scores them all with its lightning indexer and "
        "attends to 2,048; V4 keeps a 128-token window in every layer plus compressed entries, one "
        "per 4 tokens with an indexer choosing 512 (Flash) or 1,024 (Pro) of them (CSA) or one per "
        "128 tokens, all attended (HCA). FLOPs are equivalent FP8 FLOPs, the unit of DeepSeek's "
        "V4 report (a BF16 FLOP counts 2, an FP4 one 0.5, FP4 weights times FP8 activations 1); "
        "the KV cache is in each model's FP8 format (V4: FP8 with BF16 RoPE dimensions, FP4 index "
        "keys). 1M is 1,048,576 tokens.</p>",
        table_html(header, rows),
        figure_html(
            "arch_per_token.png",
            "FLOPs of one decoded token and KV bytes per token against the context; stars: the "
            "DeepSeek-V4 model card's shares of V3.2 at 1M tokens",
        ),
        "<p>How each part is counted, and the sources: docs/serving-model.md, "
        '"Architectures: parameters, KV cache and FLOPs per token".</p>',
    ]
    return Section("architectures", "Architectures: V3, V3.2, V4-Flash, V4-Pro", "".join(parts))
