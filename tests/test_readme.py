"""The README's promises a new user tries first: its Python code blocks run as written, and its install
commands use the pinned constraints that `.ci/run` proves on a fresh virtualenv."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


@pytest.mark.parametrize("i", range(len(code_blocks("python"))))
def test_readme_python_block_runs_as_written(i, capsys):
    block = code_blocks("python")[i]
    namespace: dict = {"__name__": f"readme_block_{i}"}
    exec(compile(block, f"README.md python block {i}", "exec"), namespace)   # raises on any error


def test_readme_has_a_python_block():
    assert code_blocks("python"), "the README's library snippet is gone"


def test_readme_commands_install_the_pinned_set():
    """Command 1 and 2 install with -c constraints.txt (the tested versions), and .ci/run runs command 2."""
    first = code_blocks("bash")[0]
    cmds = [ln for ln in first.splitlines() if ln.startswith("pip install")]
    assert len(cmds) == 2, first
    for cmd in cmds:
        assert "-c constraints.txt" in cmd, cmd
    # .ci/run runs command 2 verbatim (its CMD, checked against the README, and the line it executes)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert f"CMD='{cmds[1]}'" in ci and cmds[1] in ci and any("-m venv" in ln for ln in ci)


def test_constraints_pin_the_stack_exactly():
    pins = {}
    for ln in (REPO / "constraints.txt").read_text().splitlines():
        ln = ln.split("#", 1)[0].strip()
        if ln:
            name, _, ver = ln.partition("==")
            assert ver, f"constraints.txt: {ln!r} is not an exact pin (name==version)"
            pins[name.lower().replace("_", "-")] = ver
    for need in ("torch", "triton", "ray", "mlflow", "pytest", "pytest-xdist", "pytest-timeout", "pyarrow"):
        assert need in pins, f"constraints.txt does not pin {need}"
