"""Under TRITON_INTERPRET=1, tests/conftest.py replaces the interpreter's tl.dot (np.matmul, the CPU's BLAS)
by a sum over k in one order per element: a row's result must not depend on where it sits in the tile, as on
a GPU, or the bitwise tests (grouped vs consecutive query tiles, tests/test_tile_group.py) hold on one CPU and
fail on another. OpenBLAS's AVX2 ("Haswell") sgemm is one whose rows differ by position; the check runs
under it in a fresh process so it fails without the conftest patch on any x86 machine."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the interpreter's dot only matters without CUDA", allow_module_level=True)
triton = pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("conftest", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))   # TRITON_INTERPRET and the interpreter patches
import torch, triton, triton.language as tl
from triton.runtime import interpreter as ti
assert getattr(ti.InterpreterBuilder.create_dot, "row_invariant", False), "row-invariant dot not installed"

@triton.jit
def mm(a, b, c, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    x = tl.load(a + m[:, None] * K + k[None, :])
    y = tl.load(b + k[:, None] * N + n[None, :])
    tl.store(c + m[:, None] * N + n[None, :], tl.dot(x, y, input_precision="ieee"))

g = torch.Generator().manual_seed(0)
bad = 0
for M, K, N in [(16, 16, 16), (32, 16, 16), (16, 64, 64)]:
    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    perm = torch.randperm(M, generator=g)
    c1, c2 = torch.empty(M, N), torch.empty(M, N)
    mm[(1,)](a, b, c1, M, K, N)
    mm[(1,)](a[perm].contiguous(), b, c2, M, K, N)
    bad += int((c1[perm] != c2).sum())
    assert torch.allclose(c1, a @ b, rtol=1e-5, atol=1e-5)
print("differing", bad)
sys.exit(1 if bad else 0)
"""


@pytest.mark.parametrize("coretype", [None, "Haswell"])
def test_interpreter_dot_does_not_depend_on_the_row_position(coretype, tmp_path):
    if coretype and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("OpenBLAS core types are x86 names")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    script = tmp_path / "dot_rows.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(REPO / "tests" / "conftest.py")], env=env, capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
