"""KV cache + cached decoding: prefill-then-decode must equal a full prefill (spec invariant)."""
from __future__ import annotations

import pytest
import torch

from nsa import NSAAttention, TinyLM
from nsa.layers.cache import NSAKVCache, StaticNSACache
from nsa.layers.compression import num_compressed

# l=8, d=4: compressed tokens are emitted at positions 7, 11, 15, ...; l_sel=8: a new selection
# block every 8 tokens; w=16 < T so the window buffer compacts several times.
NSA = dict(l=8, d=4, l_sel=8, n_sel=3, w=16)
LAYER = dict(dim=32, n_heads=4, n_kv_groups=2, d_k=8, d_v=12, **NSA)
MODEL = dict(vocab=61, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=8, **NSA)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_layer(seed: int = 0, **over) -> NSAAttention:
    torch.manual_seed(seed)
    return NSAAttention(**{**LAYER, "backend": "torch", **over}).eval()


def make_model(seed: int = 0, **over) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**{**MODEL, "backend": "torch", **over}).eval()


# ----------------------------------------------------------------------------------- cache
def test_cache_window_raw_and_emission_bookkeeping():
    torch.manual_seed(0)
    B, H, T, l, d, w = 2, 3, 70, 8, 4, 16
    names = ("k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win")
    src = {n: torch.randn(B, T, H, 4 if n[0] == "k" else 5) for n in names}  # distinct streams
    cache = NSAKVCache(l=l, d=d, w=w, capacity=2)
    emitted = []

    def phi(blocks):  # [B, m, H, l, D] -> [B, m, H, D]; the mean keeps the check simple
        return blocks.mean(3)

    def block_means(x, N):
        return torch.stack([x[:, i * d: i * d + l].mean(1) for i in range(N)], 1) if N else x[:, :0]

    first = [src[n][:, :3] for n in names]
    cache.prefill(*first, block_means(src["k_cmp"], 0), block_means(src["v_cmp"], 0))
    t = 3
    for n in (1, 1, 5, 1, 9, 1, 1, 17, 2, 29):  # ragged chunks, including multi-block ones
        emitted.append(cache.append(*[src[m][:, t:t + n] for m in names], phi, phi))
        t += n
        kv = cache.views()
        assert cache.length == t
        for m in ("k_slc", "v_slc"):
            assert torch.equal(kv[m], src[m][:, :t])
        # window: in position order, ends at t, reaches back to the chunk's first query - w + 1
        p0, sw = cache.win_pos0, kv["k_win"].shape[1]
        assert p0 + sw == t and p0 <= max(0, t - n - w + 1)
        for m in ("k_win", "v_win"):
            assert torch.equal(kv[m], src[m][:, p0:t])
        # compressed tokens: exactly the complete blocks, phi over the raw cmp stream
        N = num_compressed(t, l, d)
        assert cache.n_cmp == N
        assert torch.allclose(kv["k_cmp"], block_means(src["k_cmp"], N), atol=1e-6)
        assert torch.allclose(kv["v_cmp"], block_means(src["v_cmp"], N), atol=1e-6)
    assert sum(emitted) == num_compressed(T, l, d)
    caps = cache.capacities()
    assert caps["slc"] >= T
    assert cache.win_pos0 > 0 and caps["win"] <= 2 * (w + 29)  # compacted, stays bounded
    assert caps["raw_cmp"] <= 2 * (l + 29)


def test_static_cache_device_appends_match_the_growing_cache():
    """StaticNSACache: device-position appends (no host int per token) keep the same raw tokens,
    window (a ring) and compressed tokens as NSAKVCache; buffers are never re-allocated."""
    torch.manual_seed(0)
    B, H, T0, T, l, d, w = 2, 3, 3, 40, 8, 4, 6
    names = ("k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win")
    src = {n: torch.randn(B, T, H, 4 if n[0] == "k" else 5) for n in names}
    ref, st = NSAKVCache(l=l, d=d, w=w, capacity=2), StaticNSACache(l=l, d=d, w=w, capacity=T)

    def phi(blocks):  # NSAKVCache: [B, m, H, l, D] -> [B, m, H, D]
        return blocks.mean(3)

    def phi_one(raw):  # StaticNSACache: [B, l, H, D] -> [B, 1, H, D] (BlockCompressor.compress_block)
        return raw.mean(1, keepdim=True)

    none = src["k_cmp"][:, :0]
    ref.prefill(*[src[m][:, :T0] for m in names], none, src["v_cmp"][:, :0])
    st.prefill(*[src[m][:, :T0] for m in names], none, src["v_cmp"][:, :0])
    bufs = {k: v.data_ptr() for k, v in st.bufs.items()}
    pos = torch.tensor([T0])
    for t in range(T0, T):
        ref.append(*[src[m][:, t:t + 1] for m in names], phi, phi)
        st.append(pos, *[src[m][:, t:t + 1] for m in names], phi_one, phi_one)
        pos += 1
        kv = ref.views()
        assert torch.equal(st.k_slc[:, :t + 1], kv["k_slc"]) and torch.equal(st.v_slc[:, :t + 1], kv["v_slc"])
        p = torch.arange(max(0, t + 1 - w), t + 1)  # the window the next query needs, from the ring
        assert torch.equal(st.k_win[:, p % w], src["k_win"][:, p])
        assert torch.equal(st.v_win[:, p % w], src["v_win"][:, p])
        n = ref.n_cmp
        assert torch.allclose(st.k_cmp[:, :n], kv["k_cmp"], atol=1e-6)
        assert torch.allclose(st.v_cmp[:, :n], kv["v_cmp"], atol=1e-6)
    assert {k: v.data_ptr() for k, v in st.bufs.items()} == bufs
    with pytest.raises(ValueError, match="capacity"):
        StaticNSACache(l=l, d=d, w=w, capacity=2).prefill(*[src[m][:, :T0] for m in names], none,
                                                          src["v_cmp"][:, :0])


def test_generate_cuda_graph_needs_cuda():
    model = make_model(seed=5)
    prompt = torch.randint(0, MODEL["vocab"], (1, 4))
    with pytest.raises(ValueError, match="cuda_graph=True cannot run: it needs CUDA"):
        model.generate(prompt, 3, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph='yes'"):
        model.generate(prompt, 3, cuda_graph="yes")


def test_generate_auto_graph_is_eager_where_no_graph_applies(monkeypatch):
    """The default cuda_graph="auto" decodes eagerly on the CPU (graph_blocker says why) with the tokens of
    an explicit cuda_graph=False, and never builds the graph decoder there."""
    model = make_model(seed=5)
    prompt = torch.randint(0, MODEL["vocab"], (2, 9))
    assert "CUDA" in model.graph_blocker(prompt)
    monkeypatch.setattr(TinyLM, "_graph_decoder", lambda *a, **k: pytest.fail("graph decoder built on CPU"))
    assert torch.equal(model.generate(prompt, 6), model.generate(prompt, 6, cuda_graph=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,T0,n_new", [(1, 7, 40), (3, 150, 70)])
def test_generate_cuda_graph_equals_eager_on_gpu(B, T0, n_new):
    """One captured decode step replayed per token gives the eager greedy tokens (fp32 model)."""
    torch.manual_seed(6)
    model = TinyLM(**{**MODEL, "vocab": 97, "dim": 64, "d_k": 16, "d_v": 16, "backend": "auto"}).cuda().eval()
    prompt = torch.randint(0, 97, (B, T0), device="cuda")
    eager = model.generate(prompt, n_new, cuda_graph=False)
    graphed = model.generate(prompt, n_new, cuda_graph=True)
    assert torch.equal(graphed, eager)
    assert model.graph_blocker(prompt) is None   # so the default ("auto") takes the graph
    built = []
    real = TinyLM._graph_decoder

    def spy(self, *a, **k):
        built.append(1)
        return real(self, *a, **k)

    TinyLM._graph_decoder = spy
    try:
        assert torch.equal(model.generate(prompt, n_new), graphed) and built
    finally:
        TinyLM._graph_decoder = real
    eos = int(eager[0, T0 + 5])
    assert torch.equal(model.generate(prompt, n_new, eos_id=eos, cuda_graph=True),
                       model.generate(prompt, n_new, eos_id=eos, cuda_graph=False))
    with pytest.raises(ValueError, match="backend"):
        TinyLM(**{**MODEL, "backend": "torch"}).cuda().generate(prompt, 2, cuda_graph=True)


def test_cache_rejects_misuse():
    cache = NSAKVCache(l=8, d=4, w=16)
    with pytest.raises(ValueError, match="empty"):
        cache.views()
    with pytest.raises(ValueError, match="w="):
        NSAKVCache(l=8, d=4, w=0)


# ------------------------------------------------------------------------------ layer level
@pytest.mark.parametrize("chunks,compression,n_heads,first", [
    ([5] + [1] * 55, "mlp", 4, "prefill"),                  # G = 2, token by token
    ([3, 1, 6, 1, 1, 13, 1, 30], "linear", 6, "prefill"),  # G = 3, ragged multi-token chunks
    ([1] * 20 + [21], "mean", 2, "decode"),                 # G = 1, no prefill at all
])
def test_layer_prefill_then_decode_equals_full(chunks, compression, n_heads, first):
    layer = make_layer(compression=compression, n_heads=n_heads)
    layer.record_stats = True
    torch.manual_seed(1)
    T = sum(chunks)
    x = torch.randn(2, T, LAYER["dim"])
    with torch.no_grad():
        full = layer(x)
        full_idx = layer.last_block_idx
        cache = layer.new_cache(capacity=4)
        outs, idx = [], []
        t = 0
        for i, n in enumerate(chunks):
            step = layer.prefill if (i == 0 and first == "prefill") else layer.decode
            outs.append(step(x[:, t:t + n], cache))
            idx.append(layer.last_block_idx)
            t += n
    assert cache.length == T and cache.n_cmp == num_compressed(T, NSA["l"], NSA["d"])
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-4)
    assert torch.equal(torch.cat(idx, 1), full_idx)


# ------------------------------------------------------------------------------ model level
def capture_attention_outputs(model: TinyLM) -> list[list[torch.Tensor]]:
    """Test hook: record every NSAAttention output (after W_O) per layer, in call order."""
    records: list[list[torch.Tensor]] = []
    for layer in model.nsa_layers():
        rec: list[torch.Tensor] = []
        records.append(rec)

        def wrapped(o, gates, block_idx, _inner=layer._output, _rec=rec):
            y = _inner(o, gates, block_idx)
            _rec.append(y)
            return y
        layer._output = wrapped  # instance attribute shadows the method
    return records


def test_model_prefill_then_decode_equals_full_and_cache_grows():
    model = make_model()
    model.set_record_stats(True)
    torch.manual_seed(2)
    T, T0 = 60, 5
    ids = torch.randint(0, MODEL["vocab"], (2, T))
    with torch.no_grad():
        records = capture_attention_outputs(model)
        full = model(ids)
        full_attn = [r.pop() for r in records]
        full_idx = [layer.last_block_idx for layer in model.nsa_layers()]
        logits, caches = model.prefill(ids[:, :T0], capacity=4)
        outs = [logits]
        idx = [[layer.last_block_idx] for layer in model.nsa_layers()]
        start_caps = [c.capacities() for c in caches]
        for t in range(T0, T):
            outs.append(model.decode_step(ids[:, t:t + 1], caches))
            for k, layer in enumerate(model.nsa_layers()):
                idx[k].append(layer.last_block_idx)
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-4, rtol=1e-4)
    for k in range(MODEL["n_layers"]):
        assert len(records[k]) == 1 + T - T0  # one prefill call, then one call per token
        assert torch.allclose(torch.cat(records[k], 1), full_attn[k], atol=1e-5, rtol=1e-4)
        assert torch.equal(torch.cat(idx[k], 1), full_idx[k])
    for c, cap0 in zip(caches, start_caps):
        assert c.length == T and c.n_cmp == num_compressed(T, NSA["l"], NSA["d"])
        caps = c.capacities()
        assert caps["slc"] >= T > cap0["slc"]  # grew (several doublings) past the initial size
        assert caps["cmp"] >= c.n_cmp > cap0["cmp"]


def test_greedy_generate_equals_full_recompute_argmax():
    model = make_model(seed=3)
    torch.manual_seed(3)
    prompt = torch.randint(0, MODEL["vocab"], (2, 6))
    n_new = 30
    out = model.generate(prompt, n_new)
    assert out.shape == (2, 6 + n_new) and torch.equal(out[:, :6], prompt)
    ids = prompt
    with torch.no_grad():
        for _ in range(n_new):
            nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    assert torch.equal(out, ids)


def test_generate_eos_padding_and_sampling():
    model = make_model(seed=4)
    torch.manual_seed(4)
    prompt = torch.randint(0, MODEL["vocab"], (3, 4))
    greedy = model.generate(prompt, 12)
    eos = int(greedy[0, 4 + 3])  # the 4th generated token of row 0
    out = model.generate(prompt, 12, eos_id=eos)
    for b in range(3):
        row, ref = out[b, 4:], greedy[b, 4:]
        hits = (ref == eos).nonzero()
        first = int(hits[0]) if len(hits) else 12
        assert torch.equal(row[: first + 1], ref[: first + 1])  # same tokens up to the first eos
        assert (row[first:] == eos).all()  # then eos padding (vacuous when no eos was produced)
    # top_k=1 sampling is greedy whatever the temperature
    assert torch.equal(model.generate(prompt, 8, temperature=1.5, top_k=1), greedy[:, :12])
    gen = torch.Generator().manual_seed(0)
    s = model.generate(prompt, 8, temperature=1.0, top_k=5, generator=gen)
    assert s.shape == (3, 12) and int(s.min()) >= 0 and int(s.max()) < MODEL["vocab"]
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, 2, temperature=1.0, top_k=0)
