"""Figures of a plan: the slot map (GPUs grouped by node, each slot labelled with its expert and
coloured by its load, like the example in DeepSeek's EPLB release) and GPU loads against the mean."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeinfra.atomicio import atomic_path
from moeinfra.eplb.metrics import evaluate
from moeinfra.eplb.plan import Plan, replica_load
from moeinfra.errors import InputError

_LABEL_LIMIT = 64  # write expert ids into the cells only when the GPUs are few enough to read them


def plot_plan(
    plan: Plan,
    load: np.ndarray,
    out: str | Path,
    *,
    layer: int | None = None,
    title: str | None = None,
) -> Path:
    """Draw one layer of ``plan`` under ``load [L, E]`` to ``out`` (PNG or SVG by suffix).

    ``layer`` defaults to the layer with the largest max/mean GPU load. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluation = evaluate(plan, load)
    if layer is None:
        layer = int(evaluation.max_over_mean.argmax())
    if not 0 <= layer < plan.num_layers:
        raise InputError(f"layer={layer} must be in 0..{plan.num_layers - 1}")
    out = Path(out)
    if out.suffix not in (".png", ".svg"):
        raise InputError(f"figure path {str(out)!r} must end in .png or .svg")
    lay = plan.layout
    slots = replica_load(np.asarray(load, dtype=np.float64), plan.phy2log, plan.logcnt)[layer]
    grid_load = slots.reshape(lay.num_gpus, lay.slots_per_gpu).T
    grid_expert = plan.phy2log[layer].reshape(lay.num_gpus, lay.slots_per_gpu).T
    gpu_load = evaluation.gpu_load[layer]

    width = min(24.0, 4.0 + 0.32 * lay.num_gpus)
    fig, (ax_map, ax_bar) = plt.subplots(
        2,
        1,
        figsize=(width, 3.0 + 0.35 * lay.slots_per_gpu + 2.5),
        height_ratios=[lay.slots_per_gpu + 1, 4],
    )
    image = ax_map.imshow(grid_load, aspect="auto", cmap="YlOrRd", interpolation="nearest")
    if lay.num_gpus <= _LABEL_LIMIT:
        threshold = grid_load.max() * 0.6 if grid_load.size else 0
        for slot in range(lay.slots_per_gpu):
            for gpu in range(lay.num_gpus):
                colour = "white" if grid_load[slot, gpu] > threshold else "black"
                ax_map.text(
                    gpu,
                    slot,
                    str(grid_expert[slot, gpu]),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color=colour,
                )
    for boundary in range(lay.gpus_per_node, lay.num_gpus, lay.gpus_per_node):
        ax_map.axvline(boundary - 0.5, color="black", linewidth=2)
        ax_bar.axvline(boundary - 0.5, color="black", linewidth=1, alpha=0.5)
    ax_map.set_yticks(range(lay.slots_per_gpu))
    ax_map.set_ylabel("slot")
    ax_map.set_xlabel(f"GPU ({lay.num_nodes} nodes x {lay.gpus_per_node} GPUs; cells: expert id)")
    fig.colorbar(image, ax=ax_map, label="load per replica", fraction=0.02, pad=0.01)

    mean = gpu_load.mean()
    spread = float(gpu_load.max() - gpu_load.min())
    ax_bar.set_ylim(
        max(0.0, float(gpu_load.min()) - spread - 0.02 * mean),
        float(gpu_load.max()) + 0.5 * spread + 0.01 * mean,
    )
    ax_bar.bar(np.arange(lay.num_gpus), gpu_load, color="tab:blue", width=0.8)
    ax_bar.axhline(mean, color="tab:red", linestyle="--", label=f"mean {mean:.4g}")
    ax_bar.axhline(
        evaluation.lower_bound[layer],
        color="tab:green",
        linestyle=":",
        label=f"lower bound {evaluation.lower_bound[layer]:.4g}",
    )
    ax_bar.set_xlim(-0.5, lay.num_gpus - 0.5)
    ax_bar.set_xlabel("GPU")
    ax_bar.set_ylabel("GPU load")
    ax_bar.legend(loc="upper right", fontsize=8)
    fig.suptitle(
        title
        or f"{plan.policy} plan, layer {layer}: max/mean {evaluation.max_over_mean[layer]:.4f}, "
        f"balancedness {evaluation.balancedness[layer]:.4f}"
    )
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out


def plot_policy_comparison(
    results: dict[str, np.ndarray], out: str | Path, *, title: str = "max / mean GPU load per layer"
) -> Path:
    """Line chart of per-layer max/mean GPU load, one line per policy (``{name: [L]}``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for name, values in results.items():
        ax.plot(np.arange(len(values)), values, marker=".", label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("max / mean GPU load")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out
