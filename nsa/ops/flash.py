"""Dense attention backends: flash-attn (FA4, FA2) and torch SDPA, detected and probed once.

    o = dense_attention(q, k, v, causal=True, window=None, scale=None, backend="auto")
    name, reason = choose_dense_backend(device, dtype, head_dim, allow_flash=True)

Layout [B, T, H, D] throughout (flash-attn's own): q [B, Tq, HQ, dk], k [B, Tk, H, dk],
v [B, Tk, H, dv]; GQA by head counts (query head hq reads KV head hq // (HQ // H)). `causal` is
aligned bottom-right, as flash-attn does: query i sits at position Tk - Tq + i, so a decode step
(Tq new tokens after Tk - Tq cached ones) is the same call as a full forward. `window=w` keeps the
w most recent keys of each query (itself included): flash-attn's window_size=(w - 1, 0).

Backends, in the order "auto" tries them on CUDA (fastest first, measured: docs/kernels.md, dense backends;
"math" is the always-working floor):

    fa4             flash-attn-4, `from flash_attn.cute import flash_attn_func`; SM90+ (Hopper, Blackwell)
    fa2             flash-attn 2, `from flash_attn import flash_attn_func`; SM80+ (Ampere and later)
    sdpa_cudnn      torch SDPA restricted to one kernel (torch.nn.attention.sdpa_kernel) ...
    sdpa_flash
    sdpa_efficient
    sdpa_math
    sdpa            torch SDPA with its own dispatcher: the CPU choice (its fused CPU kernel)
    reference       explicit softmax(q k^T) v in fp32 (fp64 for fp64 inputs); tests and probes

flash-attn runs only in fp16/bf16 with aligned head sizes; `allow_flash=False` (config
`nsa.allow_flash_attn=false`, env `NSA_USE_FA2=0`) removes fa4 and fa2 from the candidates and
nothing imports them. Every candidate that can apply is probed once per (device, dtype, head size,
allow_flash) on a small GQA problem against `reference` (forward and the three gradients); the
first that passes wins and the choice is logged once with its reason.

NSA branches: the sliding-window branch and the compressed branch's regrouped causal problem are
dense problems too. `branch_flash_backend` answers, from the kernel tuning's `flash` part
(nsa/ops/tuning.py FlashBranchTuning: per branch off / auto / forced, set per device family by
measurement), whether a branch runs on flash-attn for given inputs; the Triton op
(nsa/ops/triton/function.py) then calls `dense_attention(window=w)` for the window branch and
`flash_lse` (flash-attn's own [B, N, heads, D] layout) for the compressed one.
"""
from __future__ import annotations

import logging
import math
import sys
import threading
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger("nsa.ops.flash")

FLASH_BACKENDS = ("fa4", "fa2")
SDPA_BACKENDS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math")
CUDA_ORDER = FLASH_BACKENDS + SDPA_BACKENDS
# SDPA kernels without grouped-query support (efficient answered "No available kernel" to enable_gqa=True
# while cuDNN and flash ran it; bench/results/attention_prod.json)
SDPA_NO_GQA = ("sdpa_efficient",)
BACKENDS = CUDA_ORDER + ("sdpa", "reference", "auto")
ORDER_NOTE = ("order fa4 > fa2 > sdpa_cudnn > sdpa_flash > sdpa_efficient > sdpa_math (fastest first: "
              "docs/kernels.md, dense backends)")

_lock = threading.Lock()
_choices: dict[tuple, tuple[str, str]] = {}
_probes: dict[tuple, tuple[bool, str]] = {}


# ------------------------------------------------------------------------------------ detection
def fa4_func() -> Callable | None:
    """flash-attn-4's flash_attn_func, or None when the package is not importable."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return None
    return flash_attn_func


def fa2_func() -> Callable | None:
    """flash-attn 2's flash_attn_func, or None (flash-attn-4 alone ships `flash_attn.cute` only)."""
    try:
        from flash_attn import flash_attn_func
    except Exception:  # noqa: BLE001
        return None
    return flash_attn_func


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None elsewhere. Tests replace it to stand in for a GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _head_ok(head_dim: int, lo: int = 8, hi: int = 256) -> bool:
    return lo <= head_dim <= hi and head_dim % 8 == 0


def ineligible(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
              allow_flash: bool) -> str | None:
    """None when backend `name` may run here, else why not (one phrase)."""
    cap = device_capability(device)
    half = dtype in (torch.float16, torch.bfloat16)
    if name in FLASH_BACKENDS:
        if not allow_flash:
            return "flash-attn disabled (nsa.allow_flash_attn=false)"
        if cap is None:
            return "needs CUDA"
        if not half:
            return f"needs fp16/bf16, got {str(dtype).replace('torch.', '')}"
        if not _head_ok(head_dim):
            return f"head size {head_dim} not in 8..256 step 8"
        if name == "fa4":
            if cap[0] < 9:
                return f"needs SM90+ (Hopper/Blackwell), device is SM{cap[0]}{cap[1]}"
            return None if fa4_func() is not None else "flash-attn-4 not installed (pip install -e '.[flash]')"
        if cap[0] < 8:
            return f"needs SM80+ (Ampere), device is SM{cap[0]}{cap[1]}"
        return None if fa2_func() is not None else "flash-attn 2 not installed (pip install -e '.[flash2]')"
    if cap is None:
        return "needs CUDA"
    if name in ("sdpa_cudnn", "sdpa_flash") and not half:
        return f"needs fp16/bf16, got {str(dtype).replace('torch.', '')}"
    return None


# ------------------------------------------------------------------------------------ the op
def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"dense_attention: q, k, v must be [B, T, H, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"dense_attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not match q "
                         f"{tuple(q.shape)} (same B; k and v same T and H; q and k same D)")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"dense_attention: q heads {q.shape[2]} must be a multiple of k/v heads {k.shape[2]}")
    if q.shape[1] > k.shape[1]:
        raise ValueError(f"dense_attention: Tq={q.shape[1]} > Tk={k.shape[1]}: queries are the last Tq "
                         "positions of the keys")
    if window is not None and window < 1:
        raise ValueError(f"dense_attention: window={window} must be >= 1 (or None for no window)")


def _mask(Tq: int, Tk: int, causal: bool, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [Tq, Tk] (True = attend), bottom-right aligned; None when nothing is masked."""
    if not causal and window is None:
        return None
    qpos = torch.arange(Tk - Tq, Tk, device=device)[:, None]
    kpos = torch.arange(Tk, device=device)[None, :]
    m = kpos <= qpos if causal else torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    if window is not None:
        m = m & (kpos > qpos - window)
    return m


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        window: int | None = None, scale: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, Tq, HQ, dv] in q's dtype, lse [B, HQ, Tq] fp32) by the formula, in fp32 (fp64 for fp64)."""
    B, Tq, HQ, dk = q.shape
    G = HQ // k.shape[2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = dk ** -0.5 if scale is None else scale
    kk = k.to(ct).repeat_interleave(G, dim=2)
    vv = v.to(ct).repeat_interleave(G, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(ct), kk) * scale
    m = _mask(Tq, k.shape[1], causal, window, q.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), vv)
    return o.to(q.dtype), lse.float().detach()


def _sdpa(q, k, v, causal: bool, window: int | None, scale: float, kernel: str | None) -> torch.Tensor:
    """torch SDPA in [B, T, H, D]; kernel None = torch's own dispatcher, else one SDPBackend."""
    Tq, Tk = q.shape[1], k.shape[1]
    HQ, H = q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = HQ != H
    if gqa and kernel in SDPA_NO_GQA:
        # this fused kernel refuses enable_gqa ("No available kernel"): expand k/v to HQ heads for it
        # (a copy of the small tensors per call); cuDNN, flash and math take grouped heads natively
        kt, vt = kt.repeat_interleave(HQ // H, 1), vt.repeat_interleave(HQ // H, 1)
        gqa = False
    plain_causal = causal and window is None and Tq == Tk
    no_mask = (not causal and window is None) or (causal and window is None and Tq == 1)
    mask = None if (plain_causal or no_mask) else _mask(Tq, Tk, causal, window, q.device)
    if mask is not None and kernel in ("sdpa_cudnn", "sdpa_flash"):
        kernel = None   # these take no explicit mask (a window, or a chunk after a cache): torch's dispatcher
    kw = dict(attn_mask=mask, is_causal=plain_causal, scale=scale, enable_gqa=gqa)
    if kernel is None:
        o = F.scaled_dot_product_attention(qt, kt, vt, **kw)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        be = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
              "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}[kernel]
        with sdpa_kernel(be):
            o = F.scaled_dot_product_attention(qt, kt, vt, **kw)
    return o.transpose(1, 2)


_eager_cache: dict[str, Callable] = {}


def _eager(name: str, fn: Callable) -> Callable:
    """fn as an eager island under torch.compile (flash-attn's JIT kernels are not traceable). Without
    dynamo loaded nothing is compiling and fn runs as is (torch.compiler.disable would import it)."""
    if "torch._dynamo" not in sys.modules:
        return fn
    if name not in _eager_cache:
        _eager_cache[name] = torch.compiler.disable(fn)
    return _eager_cache[name]


def _flash(name: str, q, k, v, causal: bool, window: int | None, scale: float, return_lse: bool):
    """(o [B, Tq, HQ, dv], lse [B, HQ, Tq] or None) from flash-attn `name`."""
    fn = fa4_func() if name == "fa4" else fa2_func()
    if fn is None:
        raise RuntimeError(f"dense backend {name!r} is not installed")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if name == "fa4":
        ws = (window - 1, 0) if window is not None else (None, None)
        res = _eager(name, fn)(q, k, v, softmax_scale=scale, causal=causal, window_size=ws, return_lse=return_lse)
        out, lse = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
    else:
        ws = (window - 1, 0) if window is not None else (-1, -1)
        res = _eager(name, fn)(q, k, v, softmax_scale=scale, causal=causal, window_size=ws,
                               return_attn_probs=return_lse)
        out, lse = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
    return out, (lse.float() if (return_lse and lse is not None) else None)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    window: int | None = None, scale: float | None = None, backend: str = "auto",
                    allow_flash: bool = True) -> torch.Tensor:
    """Full (or windowed) attention, GQA by head counts: q [B,Tq,HQ,dk], k [B,Tk,H,dk], v [B,Tk,H,dv]
    -> o [B,Tq,HQ,dv] in q's dtype. Causal is bottom-right aligned (see module doc). Differentiable
    in q, k, v on every backend. backend "auto" = choose_dense_backend for these inputs."""
    _check(q, k, v, window)
    if backend not in BACKENDS:
        raise ValueError(f"dense_attention: backend={backend!r} is not one of {list(BACKENDS)}")
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    auto = backend == "auto"
    if auto:
        backend = choose_dense_backend(q.device, q.dtype, q.shape[-1], allow_flash)[0]
    if backend in FLASH_BACKENDS:
        try:
            return _flash(backend, q, k, v, causal, window, sc, False)[0]
        except (RuntimeError, AssertionError, ValueError) as exc:  # flash-attn asserts on what it refuses
            if not auto or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
                raise
            backend = _flash_failed(backend, q, exc)
    if backend == "reference":
        return reference_attention(q, k, v, causal, window, sc)[0]
    return _sdpa(q, k, v, causal, window, sc, None if backend == "sdpa" else backend)


def _flash_failed(name: str, q: torch.Tensor, exc: BaseException) -> str:
    """A flash-attn call of an "auto" choice failed on a shape its probe did not cover: count it, warn
    once, and answer the best non-flash backend for this device/dtype/head size from now on."""
    import warnings

    from nsa.ops.fallbacks import count_fallback
    alt, alt_why = choose_dense_backend(q.device, q.dtype, q.shape[-1], allow_flash=False)
    count_fallback(f"dense:{name}->{alt}")
    msg = str(exc).splitlines()[0][:120] if str(exc) else ""
    why = f"{name} failed at Tq={q.shape[1]}: {type(exc).__name__}: {msg}"
    with _lock:
        _choices[(str(q.device), q.dtype, int(q.shape[-1]), True)] = (alt, f"{alt} ({why}); {alt_why}")
    warnings.warn(f"dense attention: {why}; using {alt} from now on", RuntimeWarning, stacklevel=3)
    return alt


# ------------------------------------------------------------------------------------ choice
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _probe(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[bool, str]:
    """Run backend `name` on a small causal GQA problem (B=1, T=96, 4 q heads, 2 kv heads) and compare
    output and dq/dk/dv with `reference`; relative error bound 0.02 (bf16 rounding is ~0.4%)."""
    gen = torch.Generator(device=device).manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=gen, device=device).to(dtype)  # noqa: E731
    q, k, v, do = mk(1, 96, 4, head_dim), mk(1, 96, 2, head_dim), mk(1, 96, 2, head_dim), mk(1, 96, 4, head_dim)
    try:
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
            errs = []
            for be in (name, "reference"):
                x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                o = dense_attention(x[0], x[1], x[2], causal=True, backend=be)
                errs.append([o, *torch.autograd.grad(o, x, do)])
            err = max(_rel(a, b) for a, b in zip(*errs))
    except Exception as exc:  # noqa: BLE001 - the backend cannot run here: the next one is tried
        msg = str(exc).splitlines()[0][:100] if str(exc) else ""
        return False, f"{type(exc).__name__}: {msg}"
    if not math.isfinite(err) or err > 0.02:
        return False, f"mismatch vs reference (rel err {err:.3g})"
    return True, f"probe rel err {err:.1e}"


def choose_dense_backend(device: torch.device | str, dtype: torch.dtype, head_dim: int,
                         allow_flash: bool = True) -> tuple[str, str]:
    """(backend, reason) for dense causal attention here: the first of CUDA_ORDER that applies and
    passes its probe on CUDA, "sdpa" elsewhere. Cached per arguments; logged once each."""
    dev = torch.device(device)
    key = (str(dev), dtype, int(head_dim), bool(allow_flash))
    hit = _choices.get(key)   # lock-free read (one dict lookup): traceable by torch.compile
    if hit is not None:
        return hit
    if device_capability(dev) is None:
        off = "" if allow_flash else "; flash-attn disabled (nsa.allow_flash_attn=false)"
        choice = ("sdpa", f"{dev.type}: torch SDPA (its own kernel choice; flash-attn needs CUDA){off}")
    else:
        skipped = []
        choice = ("sdpa_math", "")
        for name in CUDA_ORDER:
            why = ineligible(name, dev, dtype, head_dim, allow_flash)
            if why is None:
                if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    ok, why = True, "not probed (inside a CUDA-graph capture)"
                else:
                    pkey = (name,) + key
                    if pkey not in _probes:
                        _probes[pkey] = _probe(name, dev, dtype, head_dim)
                    ok, why = _probes[pkey]
                if ok:
                    choice = (name, f"{name} ({why})")
                    break
            skipped.append(f"{name}: {why}")
        reason = choice[1] + (f"; skipped {'; '.join(skipped)}" if skipped else "") + f"; {ORDER_NOTE}"
        choice = (choice[0], reason)
    with _lock:
        _choices[key] = choice
    log.info("dense attention on %s %s d=%d: %s", dev, str(dtype).replace("torch.", ""), head_dim, choice[1])
    return choice


def reset_choices() -> None:
    """Forget cached choices and probes (tests that install or remove a flash-attn module)."""
    with _lock:
        _choices.clear()
        _probes.clear()
        _eager_cache.clear()


# ------------------------------------------------------------------------------------ NSA branches
BRANCH_NAMES = ("win", "cmp")


def branch_flash_backend(branch: str, cfg, q: torch.Tensor, dv: int) -> tuple[str | None, str]:
    """(backend, why) for NSA branch `branch` ("win" | "cmp") on inputs q [B,T,HQ,dk] (values of dim
    dv) under cfg (nsa.ops.tuning.FlashBranchTuning): "fa4" / "fa2" / "reference", or None (the own
    kernel or SDPA) with the reason. Python ints and cached choices only: no host sync."""
    if branch not in BRANCH_NAMES:
        raise ValueError(f"branch_flash_backend: unknown branch {branch!r}; choose from {list(BRANCH_NAMES)}")
    mode = getattr(cfg, branch)
    if mode == "off":
        return None, f"tuning.flash.{branch}=off"
    if mode == "reference":
        return "reference", f"tuning.flash.{branch}=reference (fp32 math)"
    T, dk = q.shape[1], q.shape[-1]
    if T < cfg.min_t:
        return None, f"T={T} < tuning.flash.min_t={cfg.min_t}"
    if dk != dv:
        return None, f"d_k={dk} != d_v={dv}"
    if torch.are_deterministic_algorithms_enabled():
        return None, "deterministic algorithms on (flash-attn's backward is not bitwise repeatable)"
    if mode == "auto":
        name, why = choose_dense_backend(q.device, q.dtype, dk, True)
        if name not in FLASH_BACKENDS:
            return None, f"no flash-attn backend chosen here ({name})"
        return name, f"{name} (tuning.flash.{branch}=auto)"
    why = ineligible(mode, q.device, q.dtype, dk, True)
    return (None, f"{mode}: {why}") if why is not None else (mode, f"{mode} (forced by tuning.flash.{branch})")


def flash_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over a square problem on flash-attn's own layout: q [B,N,HQ',dk], k/v
    [B,N,H,*] (GQA) -> (o [B,N,HQ',dv], lse [B,HQ',N] fp32, natural log)."""
    return _flash(backend, q, k, v, True, None, scale, True)


def flash_sdpa_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cmp_dense._sdpa_lse's contract on flash-attn: q [B,HQ',N,dk], k/v [B,H,N,*] (GQA), top-left
    causal over a square problem -> (o [B,HQ',N,dv], lse [B,HQ',N] fp32, natural log)."""
    o, lse = flash_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, backend)
    return o.transpose(1, 2), lse


def policy_entries(device: torch.device, dtype: torch.dtype, head_dim: int, allow_flash: bool,
                   cfg=None) -> tuple[dict[str, str], dict[str, str]]:
    """KernelPolicy's flash-attn view: ({"dense": backend}, {"dense": reason, "win"/"cmp": note});
    cfg = the tuning's FlashBranchTuning (None: all off)."""
    name, why = choose_dense_backend(device, dtype, head_dim, allow_flash)
    notes = {}
    for b in BRANCH_NAMES:
        mode = getattr(cfg, b) if cfg is not None else "off"
        if not allow_flash:
            notes[b] = f"{b} branch not on flash-attn (nsa.allow_flash_attn=false)"
        elif mode != "off" and name in FLASH_BACKENDS:
            notes[b] = f"{b} branch on {name} from T >= {cfg.min_t} (tuning.flash.{b}={mode})"
        elif name in FLASH_BACKENDS:
            notes[b] = f"{name} available, not used for the {b} branch (tuning.flash.{b}={mode})"
    return {"dense": name}, {"dense": why, **notes}


def branch_summary(device: torch.device | str, dtype: torch.dtype, head_dim: int, allow_flash: bool, cfg) -> str:
    """One phrase for logs: which NSA branches run on flash-attn here under cfg (FlashBranchTuning).
    Probes the dense backends only when some branch may use flash-attn."""
    if not allow_flash:
        return "NSA branches on flash-attn: none (nsa.allow_flash_attn=false)"
    if cfg.win == "off" and cfg.cmp == "off":
        return "NSA branches on flash-attn: none (tuning.flash off)"
    notes = policy_entries(torch.device(device), dtype, head_dim, True, cfg)[1]
    return "NSA branches on flash-attn: " + "; ".join(notes.get(b, f"{b}: no flash-attn here ({notes['dense']})")
                                                     for b in BRANCH_NAMES)
