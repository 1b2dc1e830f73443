"""The grid's two figures (matplotlib, Agg): every lane's loss against step, and tokens/s per lane."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib
    matplotlib.use("Agg")           # no display on workers or CI; must precede pyplot's import
    import matplotlib.pyplot as plt
    return plt


def loss_plot(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Loss vs step, one line per lane that logged a curve (``loss_curve``: [[step, loss], ...])."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in records:
        curve = r.get("loss_curve") or []
        if curve:
            ax.plot([s for s, _ in curve], [v for _, v in curve], label=r["lane"],
                    linewidth=2.0 if r["lane"] == "baseline" else 1.0, marker="." if len(curve) < 30 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def toks_plot(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Steady tokens/s per lane (p50 step time), baseline highlighted; failed lanes are drawn hatched."""
    plt = _plt()
    rows = [r for r in records if r.get("toks_per_s")]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4.5))
    bars = ax.bar([r["lane"] for r in rows], [r["toks_per_s"] for r in rows],
                  color=["tab:orange" if r["lane"] == "baseline" else "tab:blue" for r in rows])
    for b, r in zip(bars, rows):
        if r["status"] != "COMPLETED":
            b.set_hatch("//")
    ax.set_ylabel("tokens/s (p50 step)")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
