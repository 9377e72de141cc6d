"""Figures of a plan: the slot map (GPUs grouped by node, each slot labelled with its expert and
coloured by its load, like the example in DeepSeek's EPLB release) and GPU loads against the mean."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeinfra.atomicio import atomic_path
from moeinfra.eplb.metrics import evaluate
from moeinfra.eplb.plan import Plan, replica_load
from moeinfra.errors import InputError
from moeinfra.numfmt import format_number

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
    The figure is :func:`plan_figure`'s.
    """
    out = Path(out)
    if out.suffix not in (".png", ".svg"):
        raise InputError(f"figure path {str(out)!r} must end in .png or .svg")
    import matplotlib.pyplot as plt

    fig = plan_figure(plan, load, layer=layer, title=title)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out


def plan_figure(
    plan: Plan, load: np.ndarray, *, layer: int | None = None, title: str | None = None
):
    """The matplotlib Figure :func:`plot_plan` saves; three axes, top to bottom:

    * the slot map ``[slots_per_gpu, num_gpus]``, each cell labelled with its expert, coloured by its
      load per replica;
    * the load of each GPU as bars from 0, with the mean and the lower bound on the maximum GPU load
      (:func:`moeinfra.eplb.metrics.lower_bound`) as lines of different styles, values in the legend;
    * each GPU's difference from the mean in % of the mean, the imbalance itself, on its own axis.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    evaluation = evaluate(plan, load)
    if layer is None:
        layer = int(evaluation.max_over_mean.argmax())
    if not 0 <= layer < plan.num_layers:
        raise InputError(f"layer={layer} must be in 0..{plan.num_layers - 1}")
    lay = plan.layout
    slots = replica_load(np.asarray(load, dtype=np.float64), plan.phy2log, plan.logcnt)[layer]
    grid_load = slots.reshape(lay.num_gpus, lay.slots_per_gpu).T
    grid_expert = plan.phy2log[layer].reshape(lay.num_gpus, lay.slots_per_gpu).T
    gpu_load = evaluation.gpu_load[layer]
    mean = float(gpu_load.mean())
    bound = float(evaluation.lower_bound[layer])

    width = min(24.0, 4.5 + 0.32 * lay.num_gpus)
    fig, (ax_map, ax_bar, ax_diff) = plt.subplots(
        3,
        1,
        figsize=(width, 3.0 + 0.35 * lay.slots_per_gpu + 5.0),
        height_ratios=[lay.slots_per_gpu + 1, 4, 3],
        layout="constrained",
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
        for ax in (ax_bar, ax_diff):
            ax.axvline(boundary - 0.5, color="black", linewidth=1, alpha=0.4)
    ax_map.set_yticks(range(lay.slots_per_gpu))
    ax_map.set_ylabel("slot")
    ax_map.set_xlabel(f"GPU ({lay.num_nodes} nodes x {lay.gpus_per_node} GPUs; cells: expert id)")
    colorbar = fig.colorbar(image, ax=ax_map, label="load per replica", fraction=0.03, pad=0.01)
    colorbar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_number(v)))

    gpus = np.arange(lay.num_gpus)
    ax_bar.bar(gpus, gpu_load, color="tab:blue", width=0.8, label="GPU load")
    # Equal values must stay visible: the mean solid and wide, the bound dashed and narrow on top.
    ax_bar.axhline(mean, color="tab:red", linewidth=2.4, label=f"mean {format_number(mean)}")
    ax_bar.axhline(
        bound,
        color="black",
        linestyle=(0, (4, 3)),
        linewidth=1.2,
        label=f"lower bound on max {format_number(bound)}"
        + (" (= mean)" if np.isclose(bound, mean, rtol=1e-9) else ""),
    )
    ax_bar.set_ylim(0, max(float(gpu_load.max()), bound) * 1.3)
    ax_bar.set_xlim(-0.5, lay.num_gpus - 0.5)
    ax_bar.set_ylabel("GPU load")
    ax_bar.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_number(v)))
    ax_bar.legend(loc="upper left", fontsize=8, ncol=3, framealpha=0.9)

    diff = (gpu_load / mean - 1.0) * 100.0 if mean else np.zeros_like(gpu_load)
    ax_diff.bar(gpus, diff, color=np.where(diff > 0, "tab:red", "tab:blue"), width=0.8)
    ax_diff.axhline(0.0, color="black", linewidth=0.8)
    if mean and not np.isclose(bound, mean, rtol=1e-9):
        ax_diff.axhline(
            (bound / mean - 1.0) * 100.0,
            color="black",
            linestyle=(0, (4, 3)),
            linewidth=1.2,
            label="lower bound on max",
        )
        ax_diff.legend(loc="upper left", fontsize=8)
    reach = max(float(np.abs(diff).max()), abs(bound / mean - 1.0) * 100.0 if mean else 0.0)
    reach = reach if reach > 0 else 1.0
    ax_diff.set_ylim(-1.25 * reach, 1.25 * reach)
    ax_diff.set_xlim(-0.5, lay.num_gpus - 0.5)
    ax_diff.set_xlabel("GPU")
    ax_diff.set_ylabel("load - mean\n(% of mean)")
    ax_diff.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+.3g}%" if v else "0"))
    heaviest = int(np.argmax(diff))
    ax_diff.annotate(
        f"max {diff[heaviest]:+.3g}%",
        (heaviest, diff[heaviest]),
        xytext=(0, 3),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize=8,
    )
    fig.suptitle(
        title
        or f"{plan.policy} plan, layer {layer}: max/mean {evaluation.max_over_mean[layer]:.4f}, "
        f"balancedness {evaluation.balancedness[layer]:.4f}"
    )
    return fig


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
    ax.set_ylabel("max / mean GPU load (1 = even)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out
