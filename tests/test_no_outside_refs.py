"""Nothing in the repository points outside it: a clone must be self-contained.

Developer notes that lived beside the checkout (NSA_SPEC, RAY_NOTES, FLASH_NOTES, DESIGN.md under
../shared) are not in a clone, so tracked text may not cite them; their content lives in docs/.
Relative links in README.md, docs/*.md (and every tracked .md) must reach a tracked file. Fast, CPU only, no imports of nsa.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent
SELF = "tests/test_no_outside_refs.py"   # names the patterns, so it is the one file exempt
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ".json"}

# (pattern, why it points outside); /mnt/shared and /shared/runs are cluster mounts, not these
FORBIDDEN = [
    (re.compile(r"\.\./shared\b"), "the developer's shared folder beside the checkout"),
    (re.compile(r"/work/shared\b"), "the developer's shared folder (absolute)"),
    (re.compile(r"NSA_SPEC"), "notes outside the repo: cite docs/nsa.md"),
    (re.compile(r"RAY_NOTES"), "notes outside the repo: cite docs/ray.md"),
    (re.compile(r"FLASH_NOTES"), "notes outside the repo: cite docs/flash.md"),
    (re.compile(r"\bDESIGN principle"), "notes outside the repo: cite docs/design.md, principle N"),
]
DESIGN_MD = re.compile(r"(?<![\w/.-])DESIGN\.md")   # a bare DESIGN.md; docs/design.md is fine

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")   # [text](target "title")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")           # [label]: target
FENCE = re.compile(r"^\s*(```|~~~)")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the scan needs git ls-files")
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def _is_text(path: str) -> bool:
    p = PurePosixPath(path)
    if p.suffix in TEXT_SUFFIXES or p.name.startswith("Dockerfile") or p.name.startswith("."):
        return p.suffix != ".json" or not path.startswith("bench/results/")   # measured data, not prose
    if p.suffix:
        return False
    with open(ROOT / path, "rb") as f:   # extension-less scripts (.ci/run, ...)
        return f.read(2) == b"#!"


def _lines(path: str) -> list[str]:
    try:
        return (ROOT / path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        return []


def test_no_reference_outside_the_repository():
    files = _tracked()
    design_in_repo = any(PurePosixPath(p).name == "DESIGN.md" for p in files)
    bad = []
    for path in files:
        if path == SELF or not _is_text(path):
            continue
        for n, line in enumerate(_lines(path), 1):
            why = next((w for rx, w in FORBIDDEN if rx.search(line)), None)
            if why is None and not design_in_repo and DESIGN_MD.search(line):
                why = "DESIGN.md is not in the repo: cite docs/design.md"
            if why:
                bad.append(f"{path}:{n}: {why}: {line.strip()[:140]}")
    assert not bad, "references outside the repository:\n" + "\n".join(bad)


def _md_targets(path: str):
    """(line number, target) of every link in a markdown file, fenced code blocks skipped."""
    in_fence = False
    for n, line in enumerate(_lines(path), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for m in LINK.finditer(line):
            yield n, m.group(1)
        m = REF_DEF.match(line)
        if m:
            yield n, m.group(1)


def _external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith(("#", "//"))


def test_markdown_links_resolve_inside_the_repository():
    files = _tracked()
    tracked = set(files)
    dirs = {str(PurePosixPath(p).parent) for p in files}
    dirs |= {str(d) for p in files for d in PurePosixPath(p).parents}
    docs = [p for p in files if p.endswith(".md")]   # README.md, docs/*.md and every other tracked page
    bad = []
    for path in docs:
        for n, target in _md_targets(path):
            if _external(target):
                continue
            rel = target.split("#", 1)[0].split("?", 1)[0]
            if not rel:
                continue
            if rel.startswith("/"):
                bad.append(f"{path}:{n}: absolute path {target!r}")
                continue
            resolved = (ROOT / PurePosixPath(path).parent / rel).resolve()
            try:
                inside = resolved.relative_to(ROOT).as_posix()
            except ValueError:
                bad.append(f"{path}:{n}: {target!r} leaves the repository")
                continue
            if inside not in tracked and inside not in dirs:
                bad.append(f"{path}:{n}: {target!r} is not a tracked file or folder")
    assert not bad, "broken relative links:\n" + "\n".join(bad)
