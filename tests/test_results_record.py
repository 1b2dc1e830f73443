"""bench/results holds the current record only: one file per benchmark or variant, each cited by bench/RESULTS.md (or
a test), none named after the run that made it; every results path RESULTS.md and the README cite exists; RESULTS.md
stays short enough to read (the history lives in git)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
README = ROOT / "README.md"

# names a run gave its file: _s10, _s29b, _h200_s28, _run1, _first, _final, _before, _after, _probe, a UTC stamp
RUN_SUFFIX = re.compile(r"(_s\d+[a-z]?|_h\d00_s\d+[a-z]?|_run\d+|_first|_final|_before|_after|_probe|_\d{8}-\d{6})"
                        r"($|_)")
CITED = re.compile(r"bench/results/([\w.-]+)")


def _files() -> list[Path]:
    return sorted(p for p in RESULTS_DIR.iterdir() if p.is_file())


def test_no_result_file_carries_a_run_suffix():
    bad = [p.name for p in _files() if RUN_SUFFIX.search(p.stem)]
    assert not bad, f"bench/results files named after a run (keep one current file per benchmark): {bad}"


def test_every_result_file_is_cited():
    cited = RESULTS_MD.read_text()
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name)
    uncited = [p.name for p in _files() if f"bench/results/{p.name}" not in cited and p.name not in tests]
    assert not uncited, f"bench/results files that bench/RESULTS.md does not cite: {uncited}"


def test_every_cited_result_exists():
    missing = sorted({f"{doc.name}: {name}" for doc in (RESULTS_MD, README)
                      for name in CITED.findall(doc.read_text())
                      if name.endswith((".json", ".txt", ".log")) and not (RESULTS_DIR / name).is_file()})
    assert not missing, f"cited bench/results files that do not exist: {missing}"


def test_results_md_is_short_and_current_state_first():
    lines = RESULTS_MD.read_text().splitlines()
    assert len(lines) < 400, f"bench/RESULTS.md has {len(lines)} lines (budget 400)"
    heads = [ln for ln in lines if ln.startswith("## ")]
    assert heads and heads[0] == "## Current state", heads


def test_the_run_suffix_pattern():
    for name in ("attention_paper_s16", "capture_meta_paper_s29b", "decode_roofs_h200_s30", "attention_prod_graph_run1",
                 "attention_prod_final_s13", "decode_20261128-112837", "train_vs_dense_s10_fp32o"):
        assert RUN_SUFFIX.search(name), name
    for name in ("attention_paper_random", "decode_8k", "decode_h100", "train_vs_dense_32k", "cpu_layer",
                 "profile_paper_captured_8k", "attention_prod_random_h100"):
        assert not RUN_SUFFIX.search(name), name
