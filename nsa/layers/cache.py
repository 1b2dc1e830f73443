"""Per-layer KV cache for NSA decoding.

What one layer keeps (spec, "Prefill and decode"):
- all raw selection keys/values k_slc/v_slc (any block may be selected later),
- the last w window keys/values k_win/v_win,
- the compressed tokens k~/v~ emitted so far,
- the raw compression-branch keys/values not yet folded into a complete block (the last l).

Storage is preallocated and grows geometrically (capacity doubling), so a decode step costs one
slice copy per buffer and never a torch.cat. The window and raw-compression buffers are *linear*
buffers of capacity >= 2 * keep: tokens are appended at the end and, when the buffer is full, the
last `keep` tokens are moved to the front (one copy every ~keep steps, O(1) amortised per token).
Their views are therefore contiguous along time and in position order, which the decode op needs
(`win_pos0` gives the absolute position of the first row).

All bookkeeping (lengths, positions) is plain Python ints: decode is host-driven and no step needs
a device->host sync. Tensors are stored detached: the cache is for inference.

StaticNSACache is the CUDA-graph form (TinyLM.generate(cuda_graph=True)): every buffer is allocated
once at a fixed capacity, the window and the raw compression tail are rings, and a decode step
writes at a *device* position tensor (index_copy_), so one captured step replays for every token.
NSAAttention.decode_static is the graph-capturable decode over it.
"""
from __future__ import annotations

from typing import Callable

import torch

from nsa.layers.compression import num_compressed, unfold_blocks

BlockFn = Callable[[torch.Tensor], torch.Tensor]  # blocks [B, m, H, l, D] -> [B, m, H, D]


class _AppendBuffer:
    """Append-only storage for several streams sharing one time axis: list of [B, cap, H, D_s]."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, int(capacity))
        self.length = 0
        self.bufs: list[torch.Tensor] = []
        self._views: tuple = (-1, None, [])   # (length, bufs, their views): kept while neither changes

    def _allocate(self, like: list[torch.Tensor], capacity: int) -> list[torch.Tensor]:
        return [x.new_empty(x.shape[0], capacity, *x.shape[2:]) for x in like]

    def _ensure(self, like: list[torch.Tensor], need: int) -> None:
        if not self.bufs:
            self.capacity = max(self.capacity, need)
            self.bufs = self._allocate(like, self.capacity)
            return
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)  # geometric growth: O(1) amortised copies
        new = self._allocate(like, new_cap)
        for dst, src in zip(new, self.bufs):
            dst[:, : self.length].copy_(src[:, : self.length])
        self.bufs, self.capacity = new, new_cap
        self._views = (-1, None, [])   # not holding the old buffers

    def append(self, xs: list[torch.Tensor]) -> None:
        n = xs[0].shape[1]
        if not self.bufs or self.length + n > self.capacity:
            self._ensure(xs, self.length + n)
        at = self.length
        for buf, x in zip(self.bufs, xs):
            buf[:, at: at + n] = _untracked(x)   # one call for the slice and its copy
        self.length = at + n

    def views(self) -> list[torch.Tensor]:
        """[:, :length] of each buffer; the same view objects while the length and buffers stay (the compressed
        tokens' views serve d decode steps; rows moved in place stay visible through them)."""
        n, bufs, views = self._views
        if n != self.length or bufs is not self.bufs:
            views = [b[:, : self.length] for b in self.bufs]
            self._views = (self.length, self.bufs, views)
        return views


class _TailBuffer(_AppendBuffer):
    """Linear buffer that only promises the last `keep` tokens (plus everything appended since).

    `pos0` is the absolute position of row 0. Before an append that would overflow, the last
    min(length, keep) rows are moved to the front; the buffer grows only if keep + n > capacity.
    """

    def __init__(self, keep: int, capacity: int | None = None) -> None:
        super().__init__(capacity if capacity is not None else 2 * keep)
        self.keep = keep
        self.pos0 = 0

    def append(self, xs: list[torch.Tensor]) -> None:
        n = xs[0].shape[1]
        if self.bufs and self.length + n > self.capacity:
            r = min(self.length, self.keep)
            start = self.length - r
            for buf in self.bufs:
                # clone: source and destination ranges may overlap
                buf[:, :r].copy_(buf[:, start: self.length].clone())
            self.pos0 += start
            self.length = r
        super().append(xs)

    def fill_tail(self, xs: list[torch.Tensor], end_pos: int) -> None:
        """Start an empty buffer from the last `keep` rows of xs (rows end at absolute end_pos)."""
        if self.length != 0:
            raise ValueError("fill_tail: buffer is not empty (use append)")
        T = xs[0].shape[1]
        r = min(T, self.keep)
        self.pos0 = end_pos - r
        super().append([x[:, T - r:] for x in xs])


class NSAKVCache:
    """Decode state of one NSAAttention layer.

    Buffers are allocated lazily from the first tensors given (batch, heads, dims, dtype, device).
    `capacity` is the initial number of raw token slots; every buffer doubles when it runs out.
    """

    def __init__(self, l: int, d: int, w: int, capacity: int = 256) -> None:
        if min(l, d, w, capacity) <= 0:
            raise ValueError(f"NSAKVCache: l={l}, d={d}, w={w}, capacity={capacity} must all be > 0")
        self.l, self.d, self.w = l, d, w
        self.slc = _AppendBuffer(capacity)                    # k_slc, v_slc: all raw tokens
        self.win = _TailBuffer(keep=w, capacity=max(2 * w, 2))  # k_win, v_win: last w
        self.raw_cmp = _TailBuffer(keep=l, capacity=2 * l)       # raw k_cmp, v_cmp: last l
        self.cmp = _AppendBuffer(capacity // d + 1)              # compressed k~, v~

    # ------------------------------------------------------------------ state
    @property
    def length(self) -> int:
        """Number of tokens seen (the absolute position of the next token)."""
        return self.slc.length

    @property
    def n_cmp(self) -> int:
        return self.cmp.length

    @property
    def win_pos0(self) -> int:
        """Absolute position of the first row of k_win/v_win."""
        return self.win.pos0

    def views(self) -> dict[str, torch.Tensor]:
        """Current contents: k_cmp/v_cmp [B,N,H,*], k_slc/v_slc [B,S,H,*], k_win/v_win [B,Sw,H,*]."""
        if not self.slc.bufs:
            raise ValueError("NSAKVCache.views: cache is empty (run prefill or append first)")
        k_slc, v_slc = self.slc.views()
        k_win, v_win = self.win.views()
        if self.cmp.bufs:
            k_cmp, v_cmp = self.cmp.views()
        else:  # nothing compressed yet: empty [B, 0, H, *] tensors of the right dtype
            k_cmp, v_cmp = k_slc[:, :0], v_slc[:, :0]
        return {"k_cmp": k_cmp, "v_cmp": v_cmp, "k_slc": k_slc, "v_slc": v_slc,
                "k_win": k_win, "v_win": v_win}

    def capacities(self) -> dict[str, int]:
        return {"slc": self.slc.capacity, "win": self.win.capacity,
                "raw_cmp": self.raw_cmp.capacity, "cmp": self.cmp.capacity}

    def nbytes(self) -> int:
        bufs = self.slc.bufs + self.win.bufs + self.raw_cmp.bufs + self.cmp.bufs
        return sum(b.numel() * b.element_size() for b in bufs)

    # ---------------------------------------------------------------- writing
    def prefill(self, k_cmp_raw: torch.Tensor, v_cmp_raw: torch.Tensor,
                k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
                k_cmp: torch.Tensor, v_cmp: torch.Tensor) -> None:
        """Fill an empty cache from a batched prefill of T tokens (all [B, T, H, *] raw, RoPE'd;
        k_cmp/v_cmp [B, N, H, *] the compressed tokens the prefill computed)."""
        if self.length != 0:
            raise ValueError("NSAKVCache.prefill: cache already holds tokens (use append)")
        T = k_slc.shape[1]
        if k_cmp.shape[1] != num_compressed(T, self.l, self.d):
            raise ValueError(f"k_cmp: expected {num_compressed(T, self.l, self.d)} compressed "
                             f"tokens for T={T}, got {k_cmp.shape[1]}")
        self.slc.capacity = max(self.slc.capacity, 2 * T)  # room to decode without regrowing at once
        self.slc.append([k_slc, v_slc])
        self.win.fill_tail([k_win, v_win], T)
        self.raw_cmp.fill_tail([k_cmp_raw, v_cmp_raw], T)
        if k_cmp.shape[1] > 0:
            self.cmp.capacity = max(self.cmp.capacity, 2 * k_cmp.shape[1])
            self.cmp.append([k_cmp, v_cmp])

    def append(self, k_cmp_raw: torch.Tensor, v_cmp_raw: torch.Tensor,
               k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
               phi_k: BlockFn, phi_v: BlockFn) -> int:
        """Append n new raw tokens ([B, n, H, *] each) and emit every compressed token whose block
        completes among them (block i completes when position i*d + l - 1 arrives), compressing
        all such blocks in one batched call of phi_k / phi_v. Returns the number emitted."""
        s0 = self.length
        n = k_slc.shape[1]
        self.slc.append([k_slc, v_slc])
        self.win.append([k_win, v_win])
        self.raw_cmp.append([k_cmp_raw, v_cmp_raw])
        first = num_compressed(s0, self.l, self.d)
        last = num_compressed(s0 + n, self.l, self.d)  # exclusive
        if last == first:
            return 0
        # the raw buffer keeps >= l old rows, so every new block (start > s0 - l) is still there
        lo = first * self.d - self.raw_cmp.pos0
        hi = (last - 1) * self.d + self.l - self.raw_cmp.pos0
        k_raw, v_raw = (b[:, lo:hi] for b in self.raw_cmp.views())
        k_new = phi_k(unfold_blocks(k_raw, self.l, self.d))  # [B, last-first, H, d_k]
        v_new = phi_v(unfold_blocks(v_raw, self.l, self.d))
        self.cmp.append([k_new, v_new])
        return last - first


def _untracked(x: torch.Tensor) -> torch.Tensor:
    """x without autograd history (an op only where autograd tracks x: a decode step under no_grad skips it)."""
    return x.detach() if x.requires_grad else x


class StaticNSACache:
    """Fixed-capacity decode state of one NSA layer for CUDA-graph replay.

    Buffers (allocated at prefill from the first tensors' batch/heads/dims/dtype/device, zero-filled):
    k_slc/v_slc [B, capacity, H, *] all raw tokens; k_win/v_win a ring of w rows (position p at row
    p % w: a one-token step needs [p - w + 1, p]); k_raw/v_raw a ring of l rows (the raw compression
    tail); k_cmp/v_cmp [B, N(capacity) + 1, H, *]. Decode positions live on the device (`pos`, given
    per step), so nothing on the host changes per token; `length` is the prompt length only.
    """

    def __init__(self, l: int, d: int, w: int, capacity: int) -> None:
        if min(l, d, w, capacity) <= 0:
            raise ValueError(f"StaticNSACache: l={l}, d={d}, w={w}, capacity={capacity} must all be > 0")
        self.l, self.d, self.w, self.capacity = l, d, w, capacity
        self.length = 0
        self.bufs: dict[str, torch.Tensor] = {}

    def __getattr__(self, name: str) -> torch.Tensor:
        bufs = self.__dict__.get("bufs", {})
        if name in bufs:
            return bufs[name]
        raise AttributeError(name)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs.values())

    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        B, _, H, dk = k.shape
        dv = v.shape[-1]
        n_cmp = num_compressed(self.capacity, self.l, self.d) + 1  # +1: see append (not-yet-visible row)
        for name, rows in (("slc", self.capacity), ("win", self.w), ("raw", self.l), ("cmp", n_cmp)):
            self.bufs[f"k_{name}"] = k.new_zeros(B, rows, H, dk)
            self.bufs[f"v_{name}"] = v.new_zeros(B, rows, H, dv)
        # ring rows of positions pos - l + 1 .. pos are (pos + ring_off) % l: one add and one mod per step
        self.ring_off = torch.arange(1 - self.l, 1, device=k.device)

    def prefill(self, k_cmp_raw: torch.Tensor, v_cmp_raw: torch.Tensor, k_slc: torch.Tensor,
                v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, k_cmp: torch.Tensor,
                v_cmp: torch.Tensor) -> None:
        """Fill from a batched prefill of T tokens (same arguments as NSAKVCache.prefill)."""
        if self.length != 0:
            raise ValueError("StaticNSACache.prefill: cache already holds tokens")
        T = k_slc.shape[1]
        if T > self.capacity:
            raise ValueError(f"StaticNSACache.prefill: {T} prompt tokens exceed capacity={self.capacity}; "
                             "allocate capacity = prompt + max new tokens")
        self._allocate(k_slc, v_slc)
        dev = k_slc.device
        self.k_slc[:, :T] = k_slc.detach()
        self.v_slc[:, :T] = v_slc.detach()
        for ring, src in (("win", (k_win, v_win)), ("raw", (k_cmp_raw, v_cmp_raw))):
            rows = self.bufs[f"k_{ring}"].shape[1]
            p = torch.arange(max(0, T - rows), T, device=dev)  # the last `rows` positions
            self.bufs[f"k_{ring}"][:, p % rows] = src[0][:, p].detach()
            self.bufs[f"v_{ring}"][:, p % rows] = src[1][:, p].detach()
        N = k_cmp.shape[1]
        self.k_cmp[:, :N] = k_cmp.detach()
        self.v_cmp[:, :N] = v_cmp.detach()
        self.length = T

    def append(self, pos: torch.Tensor, k_cmp_raw: torch.Tensor, v_cmp_raw: torch.Tensor,
               k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
               phi_k: Callable[[torch.Tensor], torch.Tensor],
               phi_v: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Write one new token ([B, 1, H, *] each) at device position pos ([1] int64), graph-safe.

        The compressed token of the block ending at pos (raw positions pos-l+1 .. pos, gathered from
        the ring; phi_k / phi_v map [B, l, H, D] -> [B, 1, H, D]) is computed every step. When a
        block really completes there (pos + 1 >= l and d | pos + 1 - l) it lands in its row
        N(pos+1) - 1; otherwise in row N(pos+1), which no query at <= pos sees and which the block's
        real completion overwrites later. So no host decision and no branch per step.
        """
        if k_slc.shape[1] != 1:
            raise ValueError(f"StaticNSACache.append: one token per step, got {k_slc.shape[1]}")
        l, d = self.l, self.d
        for name, x, rows in (("slc", (k_slc, v_slc), None), ("win", (k_win, v_win), self.w),
                              ("raw", (k_cmp_raw, v_cmp_raw), l)):
            at = pos if rows is None else pos % rows
            self.bufs[f"k_{name}"].index_copy_(1, at, _untracked(x[0]))
            self.bufs[f"v_{name}"].index_copy_(1, at, _untracked(x[1]))
        ring_rows = (pos + self.ring_off) % l                                    # positions pos-l+1..pos
        k_new = phi_k(self.k_raw.index_select(1, ring_rows))
        v_new = phi_v(self.v_raw.index_select(1, ring_rows))
        # row N(pos+1) - [a block completes at pos] = max(0, ceil((pos + 1 - l) / d)), in integers: [1]
        row = torch.div(pos + (d - l), d, rounding_mode="floor").clamp_(min=0)
        self.k_cmp.index_copy_(1, row, k_new.to(self.k_cmp.dtype))
        self.v_cmp.index_copy_(1, row, v_new.to(self.v_cmp.dtype))

