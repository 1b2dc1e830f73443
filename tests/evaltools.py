"""Tiny trained checkpoints for the evaluation and promotion tests: a few optimizer steps of the library
written straight into the checkpoint format (no Ray, no pipeline), beside a prepared data dir with a val split."""
from __future__ import annotations

from pathlib import Path

import torch

from nsa.config import RunConfig


def tiny_cfg(data: Path, attention: str = "nsa") -> RunConfig:
    cfg = RunConfig()
    cfg.model.n_layers, cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_groups = 1, 32, 2, 1
    cfg.model.d_k = cfg.model.d_v = 16
    cfg.model.attention = attention
    cfg.nsa.l, cfg.nsa.d, cfg.nsa.l_sel, cfg.nsa.n_sel, cfg.nsa.w = 16, 8, 16, 2, 32
    cfg.train.seq_len, cfg.data.path, cfg.logging.experiment = 32, str(data), "eval-test"
    return cfg


def write_data(out: Path, docs: int = 40) -> Path:
    """A prepared data dir: train shards + a val split of `val_docs` documents of Python-like text."""
    from nsa.data.docs import make_doc
    from nsa.data.shards import write_shards
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # value {i}\n" * 4 for i in range(docs)]
    recs = (make_doc(t, key=f"d{i}", url=f"file://d{i}", file_path=f"d{i}.py", dump="test")
            for i, t in enumerate(texts))
    write_shards(recs, out, val_docs=8, docs_per_shard=16)
    return out


def train_checkpoint(run_dir: Path, cfg: RunConfig, steps: int = 3, seed: int = 0, lr: float = 3e-3) -> Path:
    """`steps` Adam steps on byte rows of the train text, saved as run_dir/checkpoint_<steps>."""
    from nsa.model import TinyLM
    from nsa.train.checkpoint import build_state, checkpoint_dir_name, save_checkpoint
    torch.manual_seed(seed)
    model = TinyLM.from_config(cfg.model, cfg.nsa)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    text = b"def f(x):\n    return x * 3 + 1  # value\n" * 8
    rows = torch.tensor(list(text[: 4 * (cfg.train.seq_len + 1)])).view(4, cfg.train.seq_len + 1)
    for _ in range(steps):
        logits = model(rows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    state = build_state(model=model, optimizer=opt, scheduler=sched, scaler=torch.amp.GradScaler("cpu", enabled=False),
                        step=steps, data={"epoch": 0, "batches_in_epoch": steps, "samples_seen": 4 * steps},
                        config=cfg.to_dict(), metrics={"loss": float(loss.detach())})
    d = run_dir / checkpoint_dir_name(steps)
    save_checkpoint(d, state)
    return d
