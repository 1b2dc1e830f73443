"""The lanes grid's report on a terminal and its loss figure (nsa/launch/lanes/report.py, plots.py): every lane
has its own line style in the plot, and no line of the printed summary is wider than the terminal limit."""
from __future__ import annotations

import pytest
import yaml

from conftest import REPO
from nsa.launch.lanes.plots import draw_losses, lane_styles, loss_plot
from nsa.launch.lanes.report import TERMINAL_WIDTH, format_table, rank

SHIPPED = list(yaml.safe_load((REPO / "lanes" / "lanes.yaml").read_text())["lanes"])


def _record(name, i, **kw):
    rec = {"lane": name, "status": "COMPLETED", "error": "", "step": 40, "total_steps": 40,
           "final_loss": 2.5 + 0.01 * i, "val_loss": 2.6 + 0.01 * i, "toks_per_s": 12345.0 + i,
           "peak_mem_mib": 1800.0 + i, "stalls": [], "fallbacks": 0, "checks": {},
           "loss_curve": [[s, 5.0 - 0.1 * s - 0.01 * i] for s in range(1, 41)]}
    rec.update(kw)
    return rec


@pytest.mark.parametrize("n", [1, 11, 20, 21, 45])
def test_every_lane_gets_its_own_style(n):
    names = ["baseline"] + [f"lane{i}" for i in range(n)]
    styles = lane_styles(names)
    keys = {(tuple(s["color"]) if not isinstance(s["color"], str) else s["color"], s["linestyle"], s["marker"])
            for s in styles.values()}
    assert len(keys) == len(names)
    assert styles["baseline"]["linewidth"] > max(s["linewidth"] for k, s in styles.items() if k != "baseline")


def test_loss_plot_draws_the_shipped_lanes_distinctly(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    assert len(SHIPPED) >= 11            # more lanes than matplotlib's default 10-colour cycle
    records = [_record(name, i) for i, name in enumerate(SHIPPED)]
    fig, ax = plt.subplots()
    draw_losses(ax, records)
    drawn = {(ln.get_label(), matplotlib.colors.to_hex(ln.get_color()), ln.get_linestyle()) for ln in ax.get_lines()}
    plt.close(fig)
    assert len(drawn) == len(SHIPPED) and len({d[1:] for d in drawn}) == len(SHIPPED)
    out = loss_plot(records, tmp_path / "loss.png", "t")
    assert out.stat().st_size > 1000


def test_terminal_summary_lines_fit(tmp_path):
    """The shipped lanes with a long error, checks and a skipped lane: every printed line within the limit,
    and what used to be cut at the column (the error) is still all there, wrapped."""
    error = ("RayTaskError(RuntimeError): injected crash at step 3 (runtime.fault=crash@3) " * 4).strip()
    records = [_record(name, i) for i, name in enumerate(SHIPPED)]
    records[2].update(status="FAILED", error=error, step=2, final_loss=None, val_loss=None)
    records[3]["checks"] = {"repeat": {"max_abs_diff": 0.0, "steps": 40},
                            "prefill": {"max_abs_diff": 1.2e-3, "bound": 2e-2}}
    records[4]["stalls"] = [{"step": 7}]

    class Lane:
        name = "fp16"

    text = format_table(rank(records), [(Lane(), "needs a GPU (runtime.precision=fp16 on a CPU base) " * 3)])
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= TERMINAL_WIDTH, max(lines, key=len)
    flat = " ".join(line.strip() for line in lines)
    assert error in flat and "repeat: max loss diff 0 over 40 steps" in flat and "needs a GPU" in flat
    assert all(name in text for name in SHIPPED)
    # the markdown table keeps every column on the lane's row
    md = format_table(rank(records), [], markdown=True)
    assert any(error in row and f"| {SHIPPED[2]} |" in row for row in md.splitlines())
