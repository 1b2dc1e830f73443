"""Needle retrieval through the selection branch at 8k tokens (torch backend, CPU)."""
from __future__ import annotations

import torch

from nsa.ops import nsa_attention
from nsa.ops.common import num_cmp_tokens


def test_needle_8k_selected_and_retrieved():
    T, HQ, H, dk, dv = 8192, 2, 1, 32, 16
    l, d, l_sel, n_sel, w = 32, 16, 64, 4, 64
    gen = torch.Generator().manual_seed(0)
    N = num_cmp_tokens(T, l, d)
    rnd = lambda *s: torch.randn(*s, generator=gen) * 0.3  # noqa: E731
    q, k_slc, k_win = rnd(1, T, HQ, dk), rnd(1, T, H, dk), rnd(1, T, H, dk)
    k_cmp, v_cmp = rnd(1, N, H, dk), rnd(1, N, H, dv)
    v_slc, v_win = rnd(1, T, H, dv), rnd(1, T, H, dv)
    # the needle: selection block 20 (tokens 1280..1343), far behind the last queries
    j_needle = 20
    key = torch.randn(dk, generator=gen)
    key = key / key.norm()
    value = torch.randn(dv, generator=gen)
    i_cmp = j_needle * l_sel // d  # compression block 80 = tokens 1280..1311, inside block 20
    k_cmp[0, i_cmp, 0] = 8.0 * key
    k_slc[0, j_needle * l_sel: (j_needle + 1) * l_sel, 0] = 8.0 * key
    v_slc[0, j_needle * l_sel: (j_needle + 1) * l_sel, 0] = value
    q_last = slice(T - 256, T)
    q[0, q_last] = 8.0 * key  # the last 256 queries look for the needle
    gates = torch.zeros(1, T, HQ, 3)
    gates[..., 1] = 1.0  # selection branch only
    with torch.no_grad():
        o, idx = nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l=l, d=d,
                               l_sel=l_sel, n_sel=n_sel, w=w, backend="torch")
    assert o.shape == (1, T, HQ, dv)
    assert (idx[0, q_last] == j_needle).any(-1).all()  # selected for every probing query
    cos = torch.nn.functional.cosine_similarity(o[0, q_last].reshape(-1, dv), value[None], dim=-1)
    assert cos.min().item() > 0.99
