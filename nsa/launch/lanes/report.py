"""The grid's report: lanes ranked against the baseline (terminal or markdown table), skipped lanes with their
reasons, ``<grid dir>/lanes_summary.{json,md}`` and the two figures."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any, Optional

from nsa.launch.lanes.plan import BASELINE, GridPlan
from nsa.launch.lanes.plots import loss_plot, toks_plot
from nsa.train.reporting import write_json


def _f(x: Any, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def _score(r: dict[str, Any]) -> Optional[float]:
    return r["val_loss"] if r.get("val_loss") is not None else r.get("final_loss")


def rank(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Completed lanes by held-out loss (final training loss where no eval ran), then the failed ones; each
    gains its ratios to the baseline (loss delta, tokens/s and peak memory ratios)."""
    base = next((r for r in records if r["lane"] == BASELINE and r["status"] == "COMPLETED"), None)
    for r in records:
        r["rank"] = None
        for key, out, ratio in (("final_loss", "d_loss", False), ("val_loss", "d_val_loss", False),
                                ("toks_per_s", "toks_vs_base", True), ("peak_mem_mib", "mem_vs_base", True)):
            a, b = r.get(key), (base or {}).get(key)
            r[out] = None if a is None or b is None or (ratio and not b) else (a / b if ratio else a - b)
    ok = sorted((r for r in records if r["status"] == "COMPLETED" and _score(r) is not None), key=_score)
    for i, r in enumerate(ok, 1):
        r["rank"] = i
    rest = [r for r in records if r not in ok]
    return ok + rest


def _check_cell(r: dict[str, Any]) -> str:
    cells = []
    for name, c in (r.get("checks") or {}).items():
        d = c.get("max_abs_diff")
        if name == "repeat":
            cells.append(f"repeat: max loss diff {_f(d, '.3g')} over {c.get('steps', 0)} steps")
        elif name == "prefill":
            cells.append(f"prefill: max logit diff {_f(d, '.2g')} (bound {_f(c.get('bound'), '.2g')})")
    return "; ".join(cells) or "-"


HEAD = ["#", "lane", "status", "steps", "final loss", "vs base", "val loss", "toks/s", "x base", "peak MiB",
        "stalls", "fallbacks", "checks", "error / reason"]
TERMINAL_WIDTH = 120   # the terminal table and its notes stay within this many characters per line


def _rows(records: list[dict[str, Any]], skipped: list[tuple[Any, str]]) -> list[list[str]]:
    rows = [[_f(r.get("rank"), "d"), r["lane"], r["status"],
             f"{r['step'] if r['step'] is not None else '-'}/{r['total_steps'] or '-'}", _f(r["final_loss"]),
             _f(r.get("d_loss"), "+.4f"), _f(r["val_loss"]), _f(r["toks_per_s"], ".0f"),
             _f(r.get("toks_vs_base"), ".2f"), _f(r.get("peak_mem_mib"), ".0f"), str(len(r.get("stalls") or [])),
             str(r.get("fallbacks", 0)), _check_cell(r), r["error"] or ""]
            for r in records]
    return rows + [["-", lane.name, "SKIPPED"] + ["-"] * 10 + [f"skipped: {why}"] for lane, why in skipped]


def format_table(records: list[dict[str, Any]], skipped: list[tuple[Any, str]] = (), markdown: bool = False) -> str:
    """The markdown table has every column in full. The terminal form keeps the numbers in the table and puts
    each lane's checks and error / skip reason on wrapped note lines below it, so no line is wider than
    TERMINAL_WIDTH (with lane names of up to ~20 characters)."""
    rows = _rows(records, skipped)
    if markdown:
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        return "\n".join(["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
                         + ["| " + " | ".join(esc(c[:2000]) for c in row) + " |" for row in rows])
    head, body = ["loss" if h == "final loss" else h for h in HEAD[:-2]], [row[:-2] for row in rows]
    width = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, width)).rstrip()  # noqa: E731
    out = [line(head), line(["-" * w for w in width])] + [line(r) for r in body]
    notes = []
    for row in rows:
        for label, text in (("checks", row[-2]), ("error" if row[2] != "SKIPPED" else "", row[-1])):
            if text and text != "-":
                # wrapped rather than cut at the column: the first 600 characters of an error say what happened
                first = f"  {row[1]}: {label + ': ' if label else ''}"
                notes += textwrap.wrap(text[:600], TERMINAL_WIDTH, initial_indent=first,
                                       subsequent_indent=" " * 6, break_long_words=True, break_on_hyphens=False)
    return "\n".join(out + (["notes:"] + notes if notes else []))


def write_figures(plan: GridPlan, records: list[dict[str, Any]]) -> list[Path]:
    return [loss_plot(records, plan.grid_dir / "lanes_loss.png", f"lanes {plan.grid_id}: loss vs step"),
            toks_plot(records, plan.grid_dir / "lanes_toks_per_s.png", f"lanes {plan.grid_id}: tokens/s")]


def write_summary(plan: GridPlan, records: list[dict[str, Any]], wall_s: float, code: int) -> tuple[Path, Path]:
    """``records`` ranked (rank()); writes lanes_summary.json and .md."""
    failed = [r["lane"] for r in records if r["status"] != "COMPLETED"]
    ui = f"mlflow ui --backend-store-uri {plan.mlflow_uri}" if plan.mlflow_uri else None
    by_name = {lc.lane.name: lc for lc in plan.lanes}
    doc = {"grid": plan.grid_id, "grid_dir": str(plan.grid_dir), "base": plan.base, "experiment": plan.experiment,
           "mlflow_uri": plan.mlflow_uri, "mlflow_ui": ui, "max_concurrent": plan.max_concurrent,
           "wall_s": wall_s, "exit_code": code, "failed": failed,
           "lanes": [{**r, "overrides": by_name[r["lane"]].lane.overrides,
                      "effective_vs_baseline": by_name[r["lane"]].effective,
                      "sources": {k: v for k, v in by_name[r["lane"]].sources.items() if v != "default"}}
                     for r in records],
           "skipped": [{"lane": ln.name, "why": ln.why, "reason": why} for ln, why in plan.skipped]}
    jpath, mpath = plan.grid_dir / "lanes_summary.json", plan.grid_dir / "lanes_summary.md"
    write_json(jpath, doc)
    md = [f"# Lanes grid `{plan.grid_id}`", "", f"Base profile `{plan.base}`; {len(records)} lanes run, "
          f"{len(plan.skipped)} skipped, {plan.max_concurrent} at a time; {wall_s:.0f}s; failed: "
          f"{', '.join(failed) or 'none'}. Ranked by val loss (final loss where none); ratios against "
          "`baseline`.", "", format_table(records, plan.skipped, markdown=True), "",
          "![loss vs step](lanes_loss.png)", "", "![tokens/s](lanes_toks_per_s.png)", "", "## Lanes", ""]
    for r in records:
        lc = by_name[r["lane"]]
        eff = ", ".join(f"{k}={v}" for k, v in sorted(lc.effective.items())) or "none (the baseline)"
        md.append(f"- **{lc.lane.name}**: {lc.lane.why}. Overrides `{json.dumps(lc.lane.overrides)}`; differs "
                  f"from the baseline in: {eff}; run dir `{r['run_dir']}`")
    md += [f"- **{ln.name}** (skipped: {why}): {ln.why}" for ln, why in plan.skipped]
    if ui:
        md += ["", f"Compare in MLflow (experiment `{plan.experiment}`, tag `grid={plan.grid_id}`; the summary "
               f"run `lanes {plan.grid_id}` holds this file and the figures): `{ui}`"]
    mpath.write_text("\n".join(md) + "\n")
    return jpath, mpath
