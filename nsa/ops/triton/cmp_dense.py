"""Compressed-attention branch on a dense causal SDPA kernel (cuDNN or flash), via a residue split.

Query t sees compressed token i iff i*d + l - 1 <= t (docs/nsa.md). Write t = d*m + r (0 <= r < d): the
condition is i <= m + c_r with c_r = floor((r - l + 1) / d), a constant per residue. So the queries
of one residue r, indexed by j = m + c_r, see exactly the compressed tokens 0..j: a plain top-left
causal mask over a square [N, N] problem (N compressed tokens; j < N for every t < T). All d
residues share the same keys, so they become d * G query heads per kv head of one grouped-query
SDPA call (head order h, r, g), and the fastest dense kernels (cuDNN, flash) run the branch at
their usual efficiency instead of a masked Triton kernel. Queries with j < 0 (t < l - 1 + ...) see
no compressed token: o = 0, lse = -inf there, as in the reference.

The regrouping is one row gather each way (q rows into the dense problem's order, its output rows
back; the Triton op skips the way back, its kernels read the rows through row_slot), each with an
exact inverse, so forward and backward are gathers: no scatter, no atomics. The rows are ordered as
the dense kernel lays them out ([B, N, heads, D] for flash-attn), so nothing is copied to transpose.
(The dense kernels' own backward may not be bitwise repeatable: cuDNN's was not at 64k.)
The SDPA op is one of PyTorch's private aten entry points that return the log-sum-exp; autograd
runs the same kernel family's backward.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# backends in the order tried by "auto"
BACKENDS = ("cudnn", "flash")


class CmpMaps(NamedTuple):
    """Row maps of the regrouped compressed problem (_maps); lse_idx / lse_none are lse_slot clamped to
    0 and its -1 mask, kept here so a step does not recompute them from these cached constants."""
    slot_src: torch.Tensor
    row_slot: torch.Tensor
    lse_slot: torch.Tensor
    pad_rows: torch.Tensor
    lse_idx: torch.Tensor
    lse_none: torch.Tensor


@functools.lru_cache(maxsize=64)
def _maps(T: int, N: int, HQ: int, H: int, l: int, d: int, device: str, bnhd: bool = False):
    """Row maps between q/o rows (t, hq) of [B, T*HQ, *] and the dense problem's rows of
    [B, HQ'*N, *] (HQ' = d*HQ heads h' = h*d*G + r*G + g, position j): row h'*N + j (bhnd, the layout
    of torch's SDPA ops) or j*HQ' + h' (bnhd, flash-attn's own layout, so its inputs and outputs need
    no transposing copy); -1 = no row (a zero row is produced).

    slot_src [HQ'*N]: the (t, hq) row a dense row reads (-1 for padding rows, t >= T);
    row_slot [T*HQ]: the dense row of (t, hq) (-1 for t < l - 1, which see no compressed token);
    lse_slot [T*HQ]: the index h'*N + j of (t, hq) in the dense lse [B, HQ', N] (-1 likewise);
    pad_rows: the dense rows no query maps to (slot_src = -1).
    slot_src and row_slot are each other's inverse on the rows they map. Returns a CmpMaps on device."""
    G = HQ // H
    r = torch.arange(d).view(d, 1)
    j = torch.arange(N).view(1, N)
    c = torch.tensor([(rr - l + 1) // d for rr in range(d)]).view(d, 1)
    t = d * (j - c) + r                                             # [d, N] token of (r, j)
    ok = (t >= 0) & (t < T)
    hh = torch.arange(H).view(H, 1, 1, 1)
    gg = torch.arange(G).view(1, 1, G, 1)
    okx = ok.view(1, d, 1, N).expand(H, d, G, N)
    src = t.view(1, d, 1, N) * HQ + hh * G + gg                                  # [H, d, G, N]
    head_pos = torch.arange(H * d * G * N).view(H, d, G, N)                     # h'*N + j
    dense = (head_pos % N) * (H * d * G) + head_pos // N if bnhd else head_pos
    slot_src = torch.full((H * d * G * N,), -1, dtype=torch.int64)
    slot_src[dense[okx]] = src[okx]
    row_slot = torch.full((T * HQ,), -1, dtype=torch.int64)
    row_slot[src[okx]] = dense[okx]
    lse_slot = torch.full((T * HQ,), -1, dtype=torch.int64)
    lse_slot[src[okx]] = head_pos[okx]
    pad_rows = (slot_src < 0).nonzero().view(-1)
    return CmpMaps(*(x.to(device) for x in (slot_src, row_slot, lse_slot, pad_rows, lse_slot.clamp(min=0),
                                            (lse_slot < 0).view(1, -1))))


@triton.jit
def _gather_rows_kernel(X, IDX, Y, n_out, sxb, syb, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """Y[b, r, :] = X[b, IDX[r], :] (0 where IDX[r] < 0); rows of D contiguous elements."""
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    ok = r < n_out
    src = tl.load(IDX + r, mask=ok, other=-1)
    c = tl.arange(0, BD)
    cm = c[None, :] < D
    v = tl.load(X + b * sxb + src[:, None] * D + c[None, :], mask=(src >= 0)[:, None] & cm, other=0.0)
    tl.store(Y + b * syb + r[:, None] * D + c[None, :], v, mask=ok[:, None] & cm)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, R, D] -> y [B, len(idx), D] with y[:, i] = x[:, idx[i]] and zero rows where idx < 0
    (a Triton copy kernel, like every kernel of this package: CUDA, or the CPU under the interpreter)."""
    B, _, D = x.shape
    n = idx.numel()
    x = x.contiguous()
    y = torch.empty(B, n, D, device=x.device, dtype=x.dtype)
    if n and B:
        bd = max(16, triton.next_power_of_2(D))
        br = max(1, min(64, 8192 // bd))
        _gather_rows_kernel[(triton.cdiv(n, br), B)](x, idx, y, n, x.stride(0), y.stride(0), D=D, BD=bd, BR=br,
                                                     num_warps=4)
    return y


class _Rows(torch.autograd.Function):
    """y = gather_rows(x, idx); backward g_x = gather_rows(g, back), back being idx's inverse (every
    row some y row reads is read by exactly one; -1 elsewhere). Gathers both ways: no scatter, no
    atomics, deterministic."""

    @staticmethod
    def forward(ctx, x, idx, back):
        ctx.save_for_backward(back)
        return gather_rows(x, idx)

    @staticmethod
    def backward(ctx, g):
        (back,) = ctx.saved_tensors
        return gather_rows(g, back), None, None


def _sdpa_lse(q, k, v, scale: float, backend: str):
    """q [B, HQ', N, dk], k/v [B, H, N, *] (GQA) -> (o [B, HQ', N, dv], lse [B, HQ', N] fp32, natural)."""
    aten = torch.ops.aten
    if backend == "cudnn":
        out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    elif backend == "flash":
        out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    elif backend in ("fa4", "fa2"):   # flash-attn (nsa/ops/flash.py), the same contract
        from nsa.ops.flash import flash_sdpa_lse
        return flash_sdpa_lse(q, k, v, scale, backend)
    elif backend in ("math", "reference"):   # plain torch (CPU tests of the regrouping; O(N^2) memory)
        G = q.shape[1] // k.shape[1]
        s = torch.einsum("bhnd,bhmd->bhnm", q.float(), k.float().repeat_interleave(G, 1)) * scale
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        o = torch.einsum("bhnm,bhmd->bhnd", torch.exp(s - lse[..., None]), v.float().repeat_interleave(G, 1))
        return o.to(q.dtype), lse.detach()
    else:
        raise ValueError(f"cmp_dense backend must be one of {BACKENDS + ('fa4', 'fa2', 'math', 'reference')}, "
                         f"got {backend!r}")
    o, lse = out[0], out[1]
    return o, lse.reshape(q.shape[0], q.shape[1], q.shape[2]).float()


def bnhd_layout(backend: str) -> bool:
    """flash-attn backends (and "reference", the math stand-in for them) take [B, N, heads, D] as is;
    torch's SDPA ops and "math" take [B, heads, N, D]."""
    return backend in ("fa4", "fa2", "reference")


def cmp_maps(q: torch.Tensor, k_cmp: torch.Tensor, *, l: int, d: int, bnhd: bool) -> CmpMaps:
    """The CmpMaps of _maps for q [B,T,HQ,*] and k_cmp [B,N,H,*] (cached)."""
    T, HQ, N, H = q.shape[1], q.shape[2], k_cmp.shape[1], k_cmp.shape[2]
    return _maps(T, N, HQ, H, l, d, str(q.device), bnhd)


def cmp_attention_rows(q_rows: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, maps: CmpMaps, *,
                       T: int, HQ: int, scale: float, backend: str, bnhd: bool, rows_out: bool = False,
                       sums=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed branch from q rows already in the dense problem's order (q_rows [B, HQ'*N, dk] =
    gather_rows(q, slot_src), differentiable): (o_cmp [B,T,HQ,dv], lse_cmp fp32 [B,T,HQ]) as
    cmp_attention_dense returns them; rows_out: o_cmp left in the dense problem's rows [B, HQ'*N, dv]
    (for kernels that read it through row_slot, which saves the gather each way). sums: the op call's
    branch_sums.RowSums (fa4 / reference on bnhd: the backward takes D from its cmp slot when filled)."""
    B, dk = q_rows.shape[0], q_rows.shape[2]
    N, dv = k_cmp.shape[1], v_cmp.shape[3]
    HQd = q_rows.shape[1] // N
    if bnhd and sums is not None and backend in ("fa4", "reference"):
        from nsa.ops.branch_sums import causal_flash
        o, lse = causal_flash(q_rows.view(B, N, HQd, dk), k_cmp, v_cmp, scale, backend, sums)
    elif bnhd and backend in ("fa4", "fa2"):   # flash-attn on its own layout: no transposes, o rows come out in order
        from nsa.ops.flash import flash_lse
        o, lse = flash_lse(q_rows.view(B, N, HQd, dk), k_cmp, v_cmp, scale, backend)
    else:
        o, lse = _sdpa_lse(q_rows.view(B, N, HQd, dk).transpose(1, 2) if bnhd else q_rows.view(B, HQd, N, dk),
                           k_cmp.transpose(1, 2), v_cmp.transpose(1, 2), scale, backend)
        o = o.transpose(1, 2) if bnhd else o                                     # the rows' order
    o_rows = o.contiguous().view(B, HQd * N, dv)
    o_cmp = o_rows if rows_out else _Rows.apply(o_rows, maps.row_slot, maps.slot_src).view(B, T, HQ, dv)
    lse = lse.reshape(B, HQd * N).index_select(1, maps.lse_idx)
    lse_cmp = lse.masked_fill_(maps.lse_none, float("-inf"))   # nothing visible: -inf
    return o_cmp, lse_cmp.view(B, T, HQ)


def cmp_attention_dense(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, *, l: int, d: int,
                        scale: float, backend: str, bnhd: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed-branch attention: q [B,T,HQ,dk], k_cmp/v_cmp [B,N,H,*] (N >= 1) ->
    (o_cmp [B,T,HQ,dv] in q's dtype, lse_cmp fp32 [B,T,HQ], natural log, -inf where nothing is
    visible; lse is not differentiable). Differentiable w.r.t. q, k_cmp, v_cmp through autograd.
    bnhd: the dense problem's row layout (None: the backend's own, bnhd_layout)."""
    B, T, HQ, dk = q.shape
    bnhd = bnhd_layout(backend) if bnhd is None else bnhd
    maps = cmp_maps(q, k_cmp, l=l, d=d, bnhd=bnhd)
    qr = _Rows.apply(q.reshape(B, T * HQ, dk), maps.slot_src, maps.row_slot)
    return cmp_attention_rows(qr, k_cmp, v_cmp, maps, T=T, HQ=HQ, scale=scale, backend=backend, bnhd=bnhd)


_PROBES: dict = {}   # the probes' outcomes (a cache of results, not of failures: those are fallbacks.refuse's)


def probed(device: str, dtype: torch.dtype, dk: int, dv: int, backends: tuple = BACKENDS) -> bool:
    """Whether probe() already ran for these arguments (it launches kernels: not during a capture)."""
    return (device, dtype, dk, dv, backends) in _PROBES


def probe(device: str, dtype: torch.dtype, dk: int, dv: int,
          backends: tuple = BACKENDS) -> tuple[str | None, str]:
    """The first of `backends` that runs a small grouped-query problem of this dtype and head sizes
    here and matches a float32 reference (forward, lse and gradients), with the reason (e.g. flash
    refuses d_k != d_v). Computed once per argument tuple."""
    key = (device, dtype, dk, dv, tuple(backends))
    if key not in _PROBES:
        _PROBES[key] = _probe_once(*key)
    return _PROBES[key]


def _probe_once(device: str, dtype: torch.dtype, dk: int, dv: int, backends: tuple) -> tuple[str | None, str]:
    if not device.startswith("cuda"):
        return None, "dense compressed branch needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return None, f"dense SDPA kernels need fp16/bf16, got {dtype}"
    # its own autograd graph, isolated from the caller's: grad on even under no_grad/inference mode,
    # and identity saved-tensor hooks so a surrounding activation checkpoint does not count (or
    # offload) the probe's tensors as the layer's (the recomputation would then not match)
    with torch.inference_mode(False), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
        return _probe(device, dtype, dk, dv, backends)


def _probe(device: str, dtype: torch.dtype, dk: int, dv: int, backends: tuple) -> tuple[str | None, str]:
    why = []
    gen = torch.Generator(device=device).manual_seed(0)
    B, T, HQ, H, l, d = 1, 200, 8, 2, 32, 16
    N = (T - l) // d + 1
    mk = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=gen)  # noqa: E731
    q, kc, vc, do = mk(B, T, HQ, dk), mk(B, N, H, dk), mk(B, N, H, dv), mk(B, T, HQ, dv)
    ref_o, ref_lse, ref_g = _reference(q, kc, vc, do, l, d, dk ** -0.5)
    for be in backends:
        try:
            x = [t.detach().clone().requires_grad_() for t in (q, kc, vc)]
            o, lse = cmp_attention_dense(*x, l=l, d=d, scale=dk ** -0.5, backend=be)
            grads = torch.autograd.grad(o, x, do)
            errs = [_rel(o, ref_o), _rel(torch.where(ref_lse.isinf(), 0.0, lse),
                                         torch.where(ref_lse.isinf(), 0.0, ref_lse))]
            errs += [_rel(g, r) for g, r in zip(grads, ref_g)]
            if not bool((lse.isinf() == ref_lse.isinf()).all()) or max(errs) > 0.02:
                why.append(f"{be}: mismatch {max(errs):.3g}")
                continue
            return be, f"{be} (probe rel err {max(errs):.1e})"
        except Exception as exc:  # noqa: BLE001 - not supported here: try the next one
            why.append(f"{be}: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}")
    return None, "; ".join(why)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _reference(q, kc, vc, do, l, d, scale):
    """fp32 masked softmax attention of the compressed branch (small shapes only)."""
    x = [t.detach().float().requires_grad_() for t in (q, kc, vc)]
    qf, kf, vf = x
    T, N, G = qf.shape[1], kf.shape[1], qf.shape[2] // kf.shape[2]
    kf_, vf_ = kf.repeat_interleave(G, 2), vf.repeat_interleave(G, 2)
    s = torch.einsum("bthd,bnhd->bhtn", qf, kf_) * scale
    vis = (torch.arange(N, device=q.device)[None, :] * d + l - 1) <= torch.arange(T, device=q.device)[:, None]
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)                                           # [B, HQ, T]
    p = torch.where(vis, torch.exp(s - torch.where(lse.isinf(), 0.0, lse)[..., None]), 0.0)
    o = torch.einsum("bhtn,bnhd->bthd", p, vf_)
    grads = torch.autograd.grad(o, x, do.float())
    return o.detach(), lse.transpose(1, 2).detach(), grads
