"""nsa_decode's per-signature decisions (nsa/ops/decode.py) and the Triton decode launcher kept per signature
(nsa/ops/triton/decode.py _Launcher): a repeated call -- one position further on a growing cache included --
decides nothing again and gives the bits a fresh, undecided call gives; another shape or dtype decides again;
bad positions still fail with the validation message. The kernels run through Triton's interpreter on CPU,
under a KernelPolicy naming the triton backend (as on CUDA)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

pytest.importorskip("triton")

from nsa.ops import KernelPolicy, decode, dispatch, nsa_decode  # noqa: E402
from nsa.ops.testing import decode_views, make_inputs  # noqa: E402
from nsa.ops.triton import decode as tdec  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(l=8, d=4, l_sel=16, n_sel=4, w=20)
TRITON = KernelPolicy("triton", DEV, "float32", {b: "triton" for b in dispatch.BRANCHES},
                      {b: "test: the triton decode kernel" for b in dispatch.BRANCHES})

pytestmark = pytest.mark.usefixtures("poison_allocations")   # unwritten outputs / scratch fail (conftest)


@pytest.fixture
def decisions(monkeypatch):
    """Counts nsa_decode's decisions and the launchers built, from a clean slate."""
    decode._CALLS.clear()
    tdec._LAUNCHERS.clear()
    n = {"decide": 0, "launcher": 0}
    real_decide, real_init = decode._decide, tdec._Launcher.__init__

    def decide(*a, **k):
        n["decide"] += 1
        return real_decide(*a, **k)

    def init(self, *a, **k):
        n["launcher"] += 1
        real_init(self, *a, **k)
    monkeypatch.setattr(decode, "_decide", decide)
    monkeypatch.setattr(tdec._Launcher, "__init__", init)
    yield n
    decode._CALLS.clear()
    tdec._LAUNCHERS.clear()


def fresh(views, pos0, win_pos0, **kw):
    """The call with nothing decided or kept: what the signature's first call computes."""
    decode._CALLS.clear()
    tdec._LAUNCHERS.clear()
    return nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, **kw)


def inputs(B=2, HQ=4, dtype=torch.float32, T=90, seed=3):
    xs = make_inputs(B, T, HQ, 2, 16, 32, l=HP["l"], d=HP["d"], seed=seed, q_scale=2.0, device=DEV)
    return [x.to(dtype) for x in xs]


def test_a_growing_cache_decides_once_and_matches_the_undecided_call(decisions):
    """Positions 29..89 one step apart on views of the same buffers (the layer's growing cache): one decision
    and one launcher for all of them, the launch geometry re-planned as the capacities pass plan_caps' steps,
    every output bitwise the fresh call's."""
    xs = inputs()
    steps = (29, 30, 31, 47, 48, 63, 64, 89)
    kept = []
    for t in steps:
        views, pos0, win_pos0 = decode_views(xs, t, 1, HP["w"], HP["l"], HP["d"])
        kept.append(nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend=TRITON))
    assert decisions == {"decide": 1, "launcher": 1}
    (la,) = tdec._LAUNCHERS.values()
    assert len(la._geos) > 1   # the geometry followed the capacities
    for t, (o, bi) in zip(steps, kept):
        views, pos0, win_pos0 = decode_views(xs, t, 1, HP["w"], HP["l"], HP["d"])
        o_f, bi_f = fresh(views, pos0, win_pos0, backend=TRITON)
        assert torch.equal(o, o_f) and torch.equal(bi, bi_f), t
        o_t, bi_t = fresh(views, pos0, win_pos0, backend="torch")
        assert torch.equal(bi, bi_t) and (o - o_t).abs().max().item() <= 1e-5, t


def test_reused_scratch_is_written_before_it_is_read(decisions):
    """The launcher's split-K scratch, kept between calls of one geometry, poisoned between them: the next call
    still gives the fresh call's bits (no kernel reads what an earlier call left)."""
    xs = inputs()
    views, pos0, win_pos0 = decode_views(xs, 70, 2, HP["w"], HP["l"], HP["d"])
    o, bi = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend=TRITON)
    (la,) = tdec._LAUNCHERS.values()
    ((_, scratch, _),) = la._scr.values()
    for x in scratch[:-1]:   # the semaphores stay: the kernels leave them at zero
        x.fill_(float("nan") if x.is_floating_point() else -7)
    o2, bi2 = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend=TRITON)
    ((_, again, _),) = la._scr.values()
    assert all(a is b for a, b in zip(scratch, again))   # the same buffers served the second call
    assert torch.equal(o, o2) and torch.equal(bi, bi2)
    assert int(scratch[-1].abs().sum()) == 0


@pytest.mark.parametrize("change", ["batch", "heads", "dtype", "scale", "policy"])
def test_another_signature_decides_again(decisions, change):
    xs = inputs()
    views, pos0, win_pos0 = decode_views(xs, 40, 1, HP["w"], HP["l"], HP["d"])
    nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend=TRITON)
    kw = dict(backend=TRITON)
    if change == "batch":
        views, pos0, win_pos0 = decode_views(inputs(B=3), 40, 1, HP["w"], HP["l"], HP["d"])
    elif change == "heads":
        views, pos0, win_pos0 = decode_views(inputs(HQ=2), 40, 1, HP["w"], HP["l"], HP["d"])
    elif change == "dtype":
        views, pos0, win_pos0 = decode_views(inputs(dtype=torch.float16), 40, 1, HP["w"], HP["l"], HP["d"])
    elif change == "scale":
        kw["scale"] = 0.3
    else:
        kw["backend"] = "torch"
    o, bi = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, **kw)
    assert decisions["decide"] == 2
    o_f, bi_f = fresh(views, pos0, win_pos0, **kw)
    assert torch.equal(o, o_f) and torch.equal(bi, bi_f)


def test_a_kept_signature_still_checks_the_positions(decisions):
    xs = inputs()
    views, pos0, win_pos0 = decode_views(xs, 50, 1, HP["w"], HP["l"], HP["d"])
    nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend=TRITON)
    for bad, msg in ((dict(pos0=pos0 + 1, win_pos0=win_pos0), "k_slc/v_slc must hold"),
                     (dict(pos0=pos0, win_pos0=win_pos0 + 1), "k_win/v_win must hold"),
                     (dict(pos0=True, win_pos0=win_pos0), "pos0 must be a non-negative Python int"),
                     (dict(pos0=pos0, win_pos0=None), "win_pos0 must be a non-negative Python int")):
        with pytest.raises(ValueError, match=msg):
            nsa_decode(*views, **bad, **HP, backend=TRITON)
    short = [views[0], views[1][:, :-1], views[2][:, :-1]] + views[3:]   # one compressed token too few
    with pytest.raises(ValueError, match="k_cmp/v_cmp must hold at least"):
        nsa_decode(*short, pos0=pos0, win_pos0=win_pos0, **HP, backend=TRITON)
    assert decisions["decide"] == 1


def test_a_stale_policy_is_resolved_again(decisions):
    """A kept decision follows dispatch's policy cache: clearing it (as the probe tests do) decides again."""
    xs = inputs()
    views, pos0, win_pos0 = decode_views(xs, 33, 1, HP["w"], HP["l"], HP["d"])
    nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend="torch")
    nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend="torch")
    assert decisions["decide"] == 1
    dispatch._cache.clear()
    nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend="torch")
    assert decisions["decide"] == 2


def test_a_stand_in_kernel_hook_is_called_per_call_and_falls_back_per_call(decisions, monkeypatch):
    """A triton package without this launcher (a stand-in hook) is called as is on every call; where it refuses
    the shape (NotImplementedError) each call runs torch and counts the fallback, as before the decisions were
    kept. Swapping the hook is another signature."""
    from nsa.ops import fallback_counts, reset_fallback_counts
    calls = []

    class FakeTriton:
        @staticmethod
        def nsa_decode_triton(*a, **k):
            calls.append(k["pos0"])
            raise NotImplementedError("stand-in: no such shape")
    monkeypatch.setattr(decode, "triton_module", lambda: FakeTriton)
    xs = inputs()
    views, pos0, win_pos0 = decode_views(xs, 60, 1, HP["w"], HP["l"], HP["d"])
    reset_fallback_counts()
    for _ in range(2):
        o, bi = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend=TRITON)
    assert calls == [pos0, pos0] and decisions["decide"] == 1
    assert fallback_counts() == {"decode:triton_unsupported->torch": 2}
    o_t, bi_t = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend="torch")
    assert torch.equal(o, o_t) and torch.equal(bi, bi_t)
    reset_fallback_counts()


class _Compiled:
    """Stands in for Triton's CompiledKernel on CPU: [grid](*every parameter in declaration order, stream=)
    runs the kernel through the interpreter, the constexprs taken from their positions (a compiled kernel's
    launcher skips them), and logs the launch. refuse: raise as a Triton with another launcher would."""

    def __init__(self, kernel, n_args: int, log: list, refuse: bool = False) -> None:
        self.kernel, self.n, self.log, self.refuse = kernel, n_args, log, refuse

    def __getitem__(self, grid):
        def run(*params, stream=None):
            if self.refuse:
                raise TypeError("launcher takes other arguments")
            names = self.kernel.arg_names
            # Triton's compiled launcher reads grid[0], grid[1] and grid[2]: a shorter grid raises there
            grid[2]
            assert len(params) == len(names) and stream is None
            self.log.append(names[0])
            self.kernel[grid](*params[:self.n], **dict(zip(names[self.n:], params[self.n:])))
        return run


@pytest.fixture
def compiled_launches(monkeypatch):
    """Launches return _Compiled handles (as on CUDA); the learnt direct-launch state starts afresh."""
    from nsa.ops.triton import decode_launch as dl
    log: list = []
    mode = {"refuse": False}
    real = dl._launch_all

    def launch_all(specs, pdl, info):
        real(specs, pdl, info)
        if info is not None:
            for name, kernel, _, args, _ in specs:
                info[name] = _Compiled(kernel, len(args), log, mode["refuse"])
    monkeypatch.setattr(dl, "_launch_all", launch_all)
    monkeypatch.setitem(dl._DIRECT, "ok", None)
    monkeypatch.setitem(dl._DIRECT, "worked", False)
    return log, mode


def misaligned(x: torch.Tensor) -> torch.Tensor:
    """x's values in storage starting one element off a 16-byte boundary (same shape and strides)."""
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
    flat = torch.empty(span + 1, dtype=x.dtype, device=x.device)[1:]
    y = flat.as_strided(x.shape, x.stride()).copy_(x)
    assert y.data_ptr() % 16 != 0
    return y


def test_kept_compiled_kernels_launch_the_same_step(decisions, compiled_launches):
    """A signature's repeated call launches its kept compiled kernels with every parameter in declaration order
    (no argument binding): the fresh call's bits. What Triton specialises on -- here q's alignment, the
    geometry -- changing launches the ordinary way once, then keeps those handles too."""
    log, _ = compiled_launches
    xs = inputs()
    runs = []
    for t, mis in ((40, False), (41, False), (41, True), (42, True), (42, False), (89, False), (88, False)):
        views, pos0, win_pos0 = decode_views(xs, t, 1, HP["w"], HP["l"], HP["d"])
        if mis:
            views = [misaligned(views[0])] + views[1:]
        n = len(log)
        o, bi = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend=TRITON)
        runs.append((len(log) - n, views, pos0, win_pos0, o, bi))
    # direct launches (4 kernels) where the specialisation was seen before; 0 on a first sight
    assert [r[0] for r in runs] == [0, 4, 0, 4, 4, 0, 4]
    assert decisions == {"decide": 1, "launcher": 1}
    for _, views, pos0, win_pos0, o, bi in runs:
        o_f, bi_f = fresh(views, pos0, win_pos0, backend=TRITON)
        assert torch.equal(o, o_f) and torch.equal(bi, bi_f), pos0


def test_a_refused_direct_launch_is_learnt(decisions, compiled_launches):
    """A Triton whose compiled kernels take other arguments refuses the first direct launch: that call and
    every later one launch the ordinary way, with the same results."""
    from nsa.ops.triton import decode_launch as dl
    log, mode = compiled_launches
    mode["refuse"] = True
    xs = inputs()
    views, pos0, win_pos0 = decode_views(xs, 50, 1, HP["w"], HP["l"], HP["d"])
    outs = [nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend=TRITON) for _ in range(3)]
    assert dl._DIRECT["ok"] is False and log == []
    o_f, bi_f = fresh(views, pos0, win_pos0, backend=TRITON)
    assert all(torch.equal(o, o_f) and torch.equal(bi, bi_f) for o, bi in outs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kept_compiled_kernels(decisions):
    """On CUDA: a repeated call launches the kept compiled kernels (this Triton takes them) with the fresh
    call's bits, a misaligned q too."""
    from nsa.ops.triton import decode_launch as dl
    hp = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)
    B, S, HQ, H, d = 2, 20001, 12, 2, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    N = (S - hp["l"]) // hp["d"] + 1

    def r(*s):
        return torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)
    t = [r(B, 1, HQ, d) * 2, r(B, N, H, d), r(B, N, H, d), r(B, S, H, d), r(B, S, H, d), r(B, 512, H, d),
         r(B, 512, H, d), torch.rand(B, 1, HQ, 3, generator=g, device="cuda")]
    kw = dict(pos0=S - 1, win_pos0=S - 512, **hp, backend="auto")
    first = nsa_decode(*t, **kw)
    again = nsa_decode(*t, **kw)
    assert dl._DIRECT["ok"] is True and dl._DIRECT["worked"] is True
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    mis = nsa_decode(misaligned(t[0]), *t[1:], **kw)
    mis2 = nsa_decode(misaligned(t[0]), *t[1:], **kw)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, mis, mis2))
