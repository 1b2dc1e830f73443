"""The grid's report: a table of lane verdicts (terminal or markdown) and ``<grid dir>/lanes_summary.{json,md}``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nsa.launch.lanes.plan import GridPlan
from nsa.train.reporting import write_json


def _f(x: Any, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def format_table(records: list[dict[str, Any]], markdown: bool = False) -> str:
    head = ["lane", "status", "steps", "final loss", "val loss", "toks/s", "wall s", "error"]
    rows = [[r["lane"], r["status"], f"{r['step'] if r['step'] is not None else '-'}/{r['total_steps'] or '-'}",
             _f(r["final_loss"]), _f(r["val_loss"]), _f(r["toks_per_s"], ".0f"), _f(r["wall_s"], ".0f"),
             (r["error"] or "")[:(2000 if markdown else 90)]] for r in records]
    if markdown:
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows])
    width = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, width)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in width])] + [line(r) for r in rows])


def write_summary(plan: GridPlan, records: list[dict[str, Any]], wall_s: float, code: int) -> tuple[Path, Path]:
    failed = [r["lane"] for r in records if r["status"] != "COMPLETED"]
    ui = f"mlflow ui --backend-store-uri {plan.mlflow_uri}" if plan.mlflow_uri else None
    doc = {"grid": plan.grid_id, "grid_dir": str(plan.grid_dir), "base": plan.base, "experiment": plan.experiment,
           "mlflow_uri": plan.mlflow_uri, "mlflow_ui": ui, "max_concurrent": plan.max_concurrent,
           "wall_s": wall_s, "exit_code": code, "failed": failed,
           "lanes": [{**r, "overrides": lc.lane.overrides, "sources": {k: v for k, v in lc.sources.items()
                                                                       if v != "default"}}
                     for r, lc in zip(records, plan.lanes)]}
    jpath, mpath = plan.grid_dir / "lanes_summary.json", plan.grid_dir / "lanes_summary.md"
    write_json(jpath, doc)
    md = [f"# Lanes grid `{plan.grid_id}`", "", f"Base profile `{plan.base}`; {len(records)} lanes, "
          f"{plan.max_concurrent} at a time; {wall_s:.0f}s; failed: {', '.join(failed) or 'none'}.", "",
          format_table(records, markdown=True), "", "## Lanes", ""]
    md += [f"- **{lc.lane.name}**: {lc.lane.why}. Overrides: `{json.dumps(lc.lane.overrides)}`; run dir "
           f"`{r['run_dir']}`" for r, lc in zip(records, plan.lanes)]
    if ui:
        md += ["", f"Compare in MLflow (experiment `{plan.experiment}`, tag `grid={plan.grid_id}`): `{ui}`"]
    mpath.write_text("\n".join(md) + "\n")
    return jpath, mpath
