"""The report's PNG figures (matplotlib, no display needed)."""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

AXES = (("step", "steps", 1.0), ("seconds", "training time (hours)", 1 / 3600),
        ("flops", "training FLOPs (PFLOP)", 1e-15))


def loss_curves(curves: dict, path: str, target=None) -> None:
    """Validation loss of each encoding against steps, training time and FLOPs: the mean over
    seeds as a line, lowest to highest seed as a band (the paper's Figure 5)."""
    figure, axes = plt.subplots(1, len(AXES), figsize=(5 * len(AXES), 4), sharey=True)
    for axis, (key, label, scale) in zip(axes, AXES):
        for encoding, curve in curves.items():
            x = np.asarray(curve[key]) * scale
            (line,) = axis.plot(x, curve["mean"], label=encoding)
            if curve["seeds"] > 1:
                axis.fill_between(x, curve["low"], curve["high"], color=line.get_color(), alpha=0.2)
        if target is not None:
            axis.axhline(target, color="grey", linestyle=":", linewidth=1)
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss")
    axes[0].legend()
    save(figure, path)


def positional_correlations(scores: np.ndarray, encoding: str, path: str) -> None:
    """[heads, n, n] content-free logits, one heatmap per head, and the [CLS] row (what [CLS]
    attends to) and column (how every position attends to [CLS]) of each head (Figure 6)."""
    heads = scores.shape[0]
    columns = max(2, min(heads, 4))  # the bottom row holds the [CLS] row and column
    rows = -(-heads // columns)
    figure = plt.figure(figsize=(3 * columns, 3 * rows + 2.6))
    grid = figure.add_gridspec(rows + 1, columns, height_ratios=[3] * rows + [2.2])
    for head in range(heads):
        axis = figure.add_subplot(grid[head // columns, head % columns])
        image = axis.imshow(scores[head], cmap="viridis")
        axis.set_title(f"head {head}", fontsize=9)
        axis.set_xticks([])
        axis.set_yticks([])
        figure.colorbar(image, ax=axis, fraction=0.046, pad=0.04)
    half = columns // 2
    for index, (values, title) in enumerate(((scores[:, 0, 1:], "[CLS] row: [CLS] -> j"),
                                             (scores[:, 1:, 0], "[CLS] column: i -> [CLS]"))):
        axis = figure.add_subplot(grid[rows, index * half:(index + 1) * half])
        for head in range(heads):
            axis.plot(np.arange(1, scores.shape[1]), values[head], linewidth=1,
                      label=f"head {head}")
        axis.legend(fontsize=7, ncol=min(heads, 4))
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("position")
    figure.suptitle(f"{encoding}: positional logits per head (content-free)")
    save(figure, path)


def save(figure, path: str) -> None:
    """The PNG appears whole (through PATH.tmp.png) or not at all."""
    figure.tight_layout()
    temporary = path[:-len(".png")] + ".tmp.png"
    figure.savefig(temporary, dpi=100)
    plt.close(figure)
    os.replace(temporary, path)
