"""Figure of the architecture arithmetic (:mod:`moeinfra.serving.arch`): FLOPs and KV bytes per token
against the context, V3, V3.2, V4-Flash and V4-Pro, with the DeepSeek-V4 model card's 1M-token
shares of V3.2 marked (matplotlib, Agg backend, PNG written atomically)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from moeinfra.atomicio import atomic_path  # noqa: E402
from moeinfra.numfmt import format_number, percent  # noqa: E402
from moeinfra.serving.arch import Architecture, published  # noqa: E402

#: The models drawn, in legend order.
MODELS = ("deepseek-v3", "deepseek-v3.2", "deepseek-v4-flash", "deepseek-v4-pro")

#: DeepSeek-V4 model card: at 1M tokens, single-token FLOPs and KV cache as a share of V3.2's.
CARD_1M = {"deepseek-v4-pro": (0.27, 0.10), "deepseek-v4-flash": (0.10, 0.07)}
CARD_CONTEXT = 1 << 20


def context_grid(lo: int = 1024, hi: int = 1 << 20, points: int = 41) -> np.ndarray:
    """Context lengths from ``lo`` to ``hi`` tokens, evenly spaced in log, as integers: ``[points]``."""
    return np.unique(np.round(np.geomspace(lo, hi, points)).astype(np.int64))


def per_token_costs(
    archs: Sequence[Architecture], contexts: np.ndarray, dtype: str = "fp8"
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per model name, ``(flops, kv)``: equivalent FP8 FLOPs of the token decoded at each context
    and KV bytes per token of a request of that many tokens in ``dtype``, each ``[contexts]``."""
    out = {}
    for a in archs:
        flops = np.array([a.decode_flops(int(c)).equivalent_fp8 for c in contexts])
        kv = np.array([a.kv_bytes_per_token(int(c), dtype) for c in contexts])
        out[a.name] = (flops, kv)
    return out


def _log_axes(ax, unit: str) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([1_024, 16_384, 131_072, 1_048_576])
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: format_number(v)))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(unit)
    ax.grid(True, which="major", alpha=0.3)


def per_token_figure(contexts: np.ndarray | None = None, dtype: str = "fp8"):
    """Two panels against the context (log-log): equivalent FP8 GFLOPs of one decoded token and KV
    KB per token (``dtype``), for :data:`MODELS`; stars at 1M tokens where the model card puts
    V4-Flash and V4-Pro (its share times this model's V3.2). Returns the matplotlib figure."""
    contexts = context_grid() if contexts is None else contexts
    archs = [published(name) for name in MODELS]
    costs = per_token_costs(archs, contexts, dtype)
    at_card = per_token_costs([published("deepseek-v3.2")], np.array([CARD_CONTEXT]), dtype)
    v32_flops, v32_kv = (float(x[0]) for x in at_card["deepseek-v3.2"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = dict(zip(MODELS, ("tab:gray", "tab:blue", "tab:orange", "tab:red"), strict=True))
    for name in MODELS:
        flops, kv = costs[name]
        left.plot(contexts, flops / 1e9, color=colors[name], label=name)
        right.plot(contexts, kv / 1e3, color=colors[name], label=name)
    for name, (flops_share, kv_share) in CARD_1M.items():
        label = f"{name} model card ({percent(flops_share)} / {percent(kv_share)} of V3.2)"
        star = dict(marker="*", ms=13, ls="", color=colors[name], markeredgecolor="black")
        left.plot(CARD_CONTEXT, flops_share * v32_flops / 1e9, label=label, **star)
        right.plot(CARD_CONTEXT, kv_share * v32_kv / 1e3, label=label, **star)
    _log_axes(left, "equivalent FP8 GFLOPs per decoded token")
    _log_axes(right, f"KV cache, KB per token ({dtype})")
    left.set_title("FLOPs of one token at the context")
    right.set_title("KV cache of a request, per token")
    right.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def plot_per_token(path: Path, contexts: np.ndarray | None = None, dtype: str = "fp8") -> Path:
    """:func:`per_token_figure` saved to ``path`` (PNG)."""
    fig = per_token_figure(contexts, dtype)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
