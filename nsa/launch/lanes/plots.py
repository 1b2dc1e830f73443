"""The grid's two figures (matplotlib, Agg): every lane's loss against step, and tokens/s per lane."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib
    matplotlib.use("Agg")           # no display on workers or CI; must precede pyplot's import
    import matplotlib.pyplot as plt
    return plt


_DASHES = ("-", "--", "-.", ":")
_MARKERS = (None, "o", "s", "^", "D", "v")


def lane_styles(names: list[str]) -> dict[str, dict[str, Any]]:
    """A distinct (colour, line style, marker) per lane: the baseline black and thick, the others walk
    tab10's colours and the four dash patterns together (10 and 4 are coprime to 20 combinations), then a
    marker per further 20, so no two lanes look alike however many there are."""
    import matplotlib
    colours = matplotlib.colormaps["tab10"].colors
    styles, k = {}, 0
    for name in names:
        if name in styles:
            continue
        if name == "baseline":
            styles[name] = {"color": "black", "linestyle": "-", "linewidth": 2.2, "marker": None}
            continue
        styles[name] = {"color": colours[k % 10], "linestyle": _DASHES[k % 4], "linewidth": 1.4,
                        "marker": _MARKERS[(k // 20) % len(_MARKERS)]}
        k += 1
    return styles


def draw_losses(ax: Any, records: list[dict[str, Any]]) -> None:
    """One line per lane that logged a curve (``loss_curve``: [[step, loss], ...]), each in its own style."""
    styles = lane_styles([r["lane"] for r in records])
    for r in records:
        curve = r.get("loss_curve") or []
        if curve:
            st = dict(styles[r["lane"]])
            if st["marker"] is None and len(curve) < 30:
                st["marker"] = "."       # short curves: show the logged points
            ax.plot([s for s, _ in curve], [v for _, v in curve], label=r["lane"], markersize=4, **st)


def loss_plot(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Loss vs step of every lane (draw_losses)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    draw_losses(ax, records)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        # outside the axes: with a dozen lanes a legend inside hides the curves
        ax.legend(fontsize=8, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0), handlelength=3)
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
