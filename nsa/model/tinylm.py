"""TinyLM: a small decoder-only LM of LlamaBlockNSA blocks, with cached NSA generation."""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nsa.layers.attention import NSAAttention
from nsa.layers.cache import NSAKVCache, StaticNSACache
from nsa.model.block import LlamaBlockNSA, RMSNorm

# config attribute names accepted for a constructor argument (first match wins)
_CONFIG_ALIASES = {"vocab": ("vocab", "vocab_size"), "compile_blocks": ("compile_blocks", "compile")}


class TinyLM(nn.Module):
    """ids [B, T] int64 -> logits [B, T, vocab].

    `grad_checkpointing` recomputes each block in backward (torch.utils.checkpoint with
    use_reentrant=False, which works under DDP and with unused-parameter detection).
    `compile_blocks` torch.compiles every block's __call__ (nn.Module.compile: state_dict keys are
    unchanged), the NSA op traced as the opaque custom op nsa::attention (nsa/ops/custom_op.py), so
    the elementwise work around it (RMSNorm, RoPE, SwiGLU, gates, casts) fuses into a few kernels;
    True = inductor, or a backend name (e.g. "aot_eager" for tests). Compilation happens on the first
    forward. torch.compile(model, fullgraph=True) on the whole model works as well.
    """

    def __init__(self, vocab: int = 256, dim: int = 512, n_layers: int = 4, n_heads: int = 8,
                 n_kv_groups: int = 2, d_k: int = 64, d_v: int = 64, l: int = 32, d: int = 16,
                 l_sel: int = 64, n_sel: int = 16, w: int = 512, grad_checkpointing: bool = False,
                 backend: str = "auto", compression: str = "mlp", ffn_mult: float = 8.0 / 3.0,
                 tie_embeddings: bool = False, rope_base: float = 10000.0,
                 norm_eps: float = 1e-6, compile_blocks: bool | str = False,
                 attention: str = "nsa", allow_flash_attn: bool = True, flash_branches: str = "preset",
                 dense_backend: str = "auto") -> None:
        super().__init__()
        if attention not in ("nsa", "dense"):
            raise ValueError(f"attention={attention!r}: choose 'nsa' or 'dense' (model.attention)")
        self.attention = attention
        for name, val in (("vocab", vocab), ("dim", dim), ("n_layers", n_layers)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name}={val!r}: must be a positive integer")
        self.vocab, self.dim, self.n_layers = vocab, dim, n_layers
        self.grad_checkpointing = bool(grad_checkpointing)
        self.tie_embeddings = bool(tie_embeddings)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            LlamaBlockNSA(dim, n_heads, n_kv_groups, d_k, d_v, l, d, l_sel, n_sel, w,
                          ffn_mult=ffn_mult, backend=backend, compression=compression,
                          rope_base=rope_base, norm_eps=norm_eps, attention=attention,
                          allow_flash_attn=allow_flash_attn, flash_branches=flash_branches,
                          dense_backend=dense_backend)
            for _ in range(n_layers))
        self.norm = RMSNorm(dim, norm_eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if self.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()
        self.compile_backend: str | None = None
        if compile_blocks:
            self.compile_blocks("inductor" if compile_blocks is True else str(compile_blocks))

    def compile_blocks(self, backend: str = "inductor") -> None:
        """torch.compile each block in place (see class doc). One compiled graph serves every block:
        the blocks share code and shapes, and parameters are graph inputs."""
        import torch._dynamo
        # every block is a separate module instance; leave room for them plus train/eval variants
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    4 * len(self.blocks))
        for blk in self.blocks:
            blk.compile(backend=backend, dynamic=False)
        self.compile_backend = backend

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02) -> None:
        """GPT-2 style: N(0, 0.02); residual-output projections scaled by 1/sqrt(2 * n_layers)."""
        out_std = init_std / math.sqrt(2 * self.n_layers)
        nn.init.normal_(self.embed.weight, std=init_std)
        if not self.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=init_std)
        for blk in self.blocks:
            blk.attn.reset_parameters(init_std=init_std, out_std=out_std)
            nn.init.normal_(blk.mlp.gate_up.weight, std=init_std)
            nn.init.normal_(blk.mlp.down.weight, std=out_std)

    @classmethod
    def from_config(cls, model_cfg: Any, nsa_cfg: Any, **overrides: Any) -> "TinyLM":
        """Build from nsa.config dataclasses (duck-typed): each constructor argument is taken from
        `overrides`, else nsa_cfg, else model_cfg (attributes of the same name), else its default."""
        return cls(**cls.config_kwargs(model_cfg, nsa_cfg, **overrides))

    @classmethod
    def config_kwargs(cls, model_cfg: Any, nsa_cfg: Any, **overrides: Any) -> dict[str, Any]:
        """The constructor arguments from_config passes (exporters record them, nsa/hf.py)."""
        kwargs: dict[str, Any] = {}
        for name in inspect.signature(cls.__init__).parameters:
            if name == "self":
                continue
            if name in overrides:
                kwargs[name] = overrides.pop(name)
                continue
            for cfg in (nsa_cfg, model_cfg):
                hit = next((a for a in _CONFIG_ALIASES.get(name, (name,)) if hasattr(cfg, a)), None)
                if hit is not None:
                    kwargs[name] = getattr(cfg, hit)
                    break
        if overrides:
            raise ValueError(f"from_config: unknown overrides {sorted(overrides)}")
        return kwargs

    # ------------------------------------------------------------------ helpers
    def nsa_layers(self) -> list[NSAAttention]:
        return [blk.attn for blk in self.blocks]

    def set_record_stats(self, flag: bool) -> None:
        for layer in self.nsa_layers():
            layer.record_stats = bool(flag)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids: expected an integer tensor [B, T], got {tuple(ids.shape)} "
                             f"{ids.dtype}")
        if ids.shape[1] == 0:
            raise ValueError("ids: need at least one token (T >= 1)")

    # ------------------------------------------------------------------ forward
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(ids)
        x = self.embed(ids)  # [B, T, dim]
        use_ckpt = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for blk in self.blocks:
            # preserve_rng_state=False: blocks use no randomness (no dropout), and saving the CUDA RNG
            # state per block is host work that also cannot run inside a CUDA-graph capture
            x = checkpoint(blk, x, use_reentrant=False, preserve_rng_state=False) if use_ckpt else blk(x)
        return self.lm_head(self.norm(x))

    def new_caches(self, capacity: int = 256) -> list[NSAKVCache]:
        return [layer.new_cache(capacity) for layer in self.nsa_layers()]

    def prefill(self, ids: torch.Tensor, capacity: int | None = None, last_only: bool = False
                ) -> tuple[torch.Tensor, list[NSAKVCache]]:
        """One batched forward over the prompt that fills every layer's cache.
        Returns (logits [B, T, vocab] or [B, 1, vocab] if last_only, caches)."""
        self._check_ids(ids)
        caches = self.new_caches(capacity if capacity is not None else 2 * ids.shape[1])
        x = self.embed(ids)
        for blk, cache in zip(self.blocks, caches):
            x = blk.prefill(x, cache)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)), caches

    def decode_step(self, ids: torch.Tensor, caches: list[NSAKVCache]) -> torch.Tensor:
        """ids [B, Tq] new tokens (usually Tq = 1) after the cached ones -> logits [B, Tq, vocab]."""
        self._check_ids(ids)
        if len(caches) != len(self.blocks):
            raise ValueError(f"caches: expected {len(self.blocks)} (one per layer), got {len(caches)}")
        x = self.embed(ids)
        for blk, cache in zip(self.blocks, caches):
            x = blk.decode(x, cache)
        return self.lm_head(self.norm(x))

    def prefill_static(self, ids: torch.Tensor, capacity: int) -> tuple[torch.Tensor, list[StaticNSACache]]:
        """Batched prompt forward that fills fixed-capacity StaticNSACaches (capacity = prompt + new
        tokens, allocated once). Returns (logits of the last token [B, 1, vocab], caches)."""
        self._check_ids(ids)
        caches = [a.new_static_cache(capacity) for a in self.nsa_layers()]
        x = self.embed(ids)
        for blk, cache in zip(self.blocks, caches):
            x = blk.prefill(x, cache)
        return self.lm_head(self.norm(x[:, -1:])), caches

    def decode_step_static(self, ids: torch.Tensor, caches: list[StaticNSACache],
                           pos: torch.Tensor) -> torch.Tensor:
        """ids [B, 1] at device position pos ([1] int64) -> logits [B, 1, vocab]; graph-capturable
        (device-side cache writes and positions, the triton decode kernel, no host sync)."""
        x = self.embed(ids)
        for blk, cache in zip(self.blocks, caches):
            x = blk.decode_static(x, cache, pos)
        return self.lm_head(self.norm(x))

    def graph_blocker(self, ids: torch.Tensor) -> str | None:
        """Why a CUDA-graph decode cannot run for these ids (None: it can): the one home of the
        conditions generate(cuda_graph="auto") chooses by and cuda_graph=True enforces."""
        if self.attention != "nsa":
            return f"the graphed decode serves NSA caches; this model is model.attention={self.attention!r}"
        if ids.device.type != "cuda" or not torch.cuda.is_available():
            return f"it needs CUDA (ids are on {ids.device}); move the model and ids to a GPU"
        from nsa.ops import KernelPolicy
        if KernelPolicy.for_device_positions(ids.device, self.embed.weight.dtype).backend != "triton":
            return "it needs the triton decode kernel (triton not importable)"
        bad = sorted({a.backend for a in self.nsa_layers() if a.backend in ("torch", "reference")})
        if bad:
            return (f"it decodes with the triton kernel but the attention backend is {bad[0]!r}; build the "
                    "model with backend='auto' or 'triton'")
        return None

    def _graph_decoder(self, ids: torch.Tensor, capacity: int):
        """(logits of the prompt's last token, step) for generate(cuda_graph=True).

        step(tok [B]) -> logits [B, 1, vocab] decodes one token. Call 1 runs eagerly on a side
        stream (compiles the kernels, creates library workspaces); call 2 captures one whole decode
        step (every layer, and the position increment) in a CUDA graph; every call replays it. The
        graph's inputs are the token buffer and the device position; its output buffer is reused.
        """
        logits, caches = self.prefill_static(ids, capacity)
        pos = torch.full((1,), ids.shape[1], dtype=torch.int64, device=ids.device)
        tok_in = ids.new_zeros(ids.shape[0], 1)
        state: dict = {"calls": 0}

        def body() -> torch.Tensor:
            out = self.decode_step_static(tok_in, caches, pos)
            pos.add_(1)
            return out

        def step(tok: torch.Tensor) -> torch.Tensor:
            tok_in.copy_(tok[:, None])
            state["calls"] += 1
            if state["calls"] == 1:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    out = body()
                torch.cuda.current_stream().wait_stream(side)
                return out
            if state["calls"] == 2:
                state["graph"] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(state["graph"]):
                    state["out"] = body()
            state["graph"].replay()
            return state["out"]

        return logits, step

    # ----------------------------------------------------------------- generate
    @staticmethod
    def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
               generator: torch.Generator | None = None, *, repetition_penalty: float = 1.0,
               seen: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, V] -> token ids [B]. temperature 0 = greedy argmax.

        repetition_penalty != 1 with `seen` ([B, V] bool: the tokens already in each sequence) scales
        their logits as CTRL does (Keskar et al. 2019; transformers' repetition_penalty): positive
        logits divided by it, negative ones multiplied, so > 1 makes a repeat less likely."""
        if repetition_penalty != 1.0 and seen is not None:
            logits = logits.float()
            logits = torch.where(seen, torch.where(logits > 0, logits / repetition_penalty,
                                                   logits * repetition_penalty), logits)
        if temperature == 0.0:
            return logits.argmax(dim=-1)
        logits = logits.float() / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [B, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, eos_id: int | None = None,
                 generator: torch.Generator | None = None, cuda_graph: bool | str = "auto",
                 repetition_penalty: float = 1.0) -> torch.Tensor:
        """ids [B, T0] -> [B, T0 + max_new_tokens]: one batched prefill, then one cached decode
        step per new token. A sequence that emits eos_id is padded with eos_id afterwards.
        The defaults decode greedily; repetition_penalty (1 = off) applies to every token of the prompt
        and of the output so far (see sample).

        cuda_graph="auto" (default) decodes through a CUDA graph wherever one applies (graph_blocker:
        an NSA model on CUDA with the triton kernels) and eagerly elsewhere; True insists (ValueError
        naming why not), False is eager. Graphed, the caches are fixed-capacity StaticNSACaches of
        T0 + max_new_tokens tokens and one decode step of all layers is captured and replayed per
        token (see _graph_decoder); the tokens equal the eager ones up to floating-point rounding
        (same kernels, other split-K geometry)."""
        self._check_ids(ids)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
        if temperature < 0:
            raise ValueError(f"temperature={temperature}: must be >= 0 (0 = greedy)")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k={top_k}: must be a positive integer or None")
        if not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
            raise ValueError(f"repetition_penalty={repetition_penalty}: must be > 0 (1 = off, > 1 penalises repeats)")
        if cuda_graph not in (True, False, "auto"):
            raise ValueError(f"cuda_graph={cuda_graph!r}: must be 'auto', True or False")
        blocker = self.graph_blocker(ids) if cuda_graph else None
        if cuda_graph is True and blocker:
            raise ValueError(f"cuda_graph=True cannot run: {blocker}; or pass cuda_graph=False")
        graphed = bool(cuda_graph) and blocker is None and max_new_tokens > 1   # one token: nothing to replay
        B, T0 = ids.shape
        out = ids.new_empty(B, T0 + max_new_tokens)  # preallocated: no torch.cat per token
        out[:, :T0] = ids
        if max_new_tokens == 0:
            return out
        if graphed:
            logits, step = self._graph_decoder(ids, T0 + max_new_tokens)
        else:
            logits, caches = self.prefill(ids, capacity=T0 + max_new_tokens, last_only=True)

            def step(tok: torch.Tensor) -> torch.Tensor:
                return self.decode_step(tok[:, None], caches)
        finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
        seen = None   # on the device and updated by scatter: the penalty adds no host sync per token
        if repetition_penalty != 1.0:
            seen = torch.zeros(B, logits.shape[-1], dtype=torch.bool, device=ids.device).scatter_(1, ids, True)
        for i in range(max_new_tokens):
            tok = self.sample(logits[:, -1], temperature, top_k, generator,
                              repetition_penalty=repetition_penalty, seen=seen)  # [B]
            if eos_id is not None:
                tok = torch.where(finished, torch.full_like(tok, eos_id), tok)
                finished |= tok == eos_id
            out[:, T0 + i] = tok
            if seen is not None:
                seen.scatter_(1, tok[:, None], True)
            if i == max_new_tokens - 1:
                break
            if eos_id is not None and bool(finished.all()):  # sync-ok: host-driven decode loop
                out[:, T0 + i + 1:] = eos_id
                break
            logits = step(tok)
        return out
