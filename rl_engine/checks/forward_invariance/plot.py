"""|Δ| per token for a profile that fails: train/infer parity and the worst cell's invariance gap."""

from __future__ import annotations

from pathlib import Path


def plot_abs_dlogp(tokens: dict, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), constrained_layout=True)
    for name, delta in tokens.get("dlogp", {}).items():
        top.plot([abs(d) for d in delta], marker="o", markersize=3, linewidth=1, label=f"infer {name}")
    top.set_title("train/infer |Δ logp| per completion token")
    top.set_xlabel("completion token (sample-major)")
    for name, diffs in tokens.get("invariance_abs_diff", {}).items():
        if any(diffs):
            bottom.plot(diffs, marker=".", markersize=3, linewidth=1, label=name)
    bottom.set_title("|logp(cell) − logp(canonical)| per token")
    bottom.set_xlabel("token (sample-major, positions 1..L-1)")
    for ax in (top, bottom):
        ax.set_yscale("symlog", linthresh=1e-7)
        ax.set_ylabel("|Δ| (symlog, 0 = bitwise)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
