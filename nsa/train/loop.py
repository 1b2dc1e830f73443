"""The training loop of one worker, independent of Ray (Ray specifics live in nsa/train/ray_loop.py).

``run_training(cfg, run_dir, env)`` drives everything; ``env`` (a ``LoopEnv``) supplies rank, device,
data, DDP wrapping, the checkpoint to resume from and ``report`` (Ray's barrier); under
``runtime.sharding=fsdp`` the loop shards the model itself and writes sharded checkpoints (nsa/train/fsdp.py);
under ``runtime.context_parallel=N`` each sequence is split across a CP group of N ranks (nsa/train/cp.py).
Per step:

    step_start hb -> faults -> fetch `accumulate` micro-batches (timed) -> train_step (no host sync)
    -> progress hb -> [log step: ONE host transfer of loss/grad-norm/non-finite count]
    -> [stats step: gate/selection stats transfer] -> [eval step] -> control decision (tiny CPU
    all-reduce) -> [checkpoint + report] -> step_end hb -> watchdog kick -> stop if agreed

Host syncs: only at log/stats/eval/checkpoint steps and the first ``logging.trace_steps`` steps
(deliberate, marked ``sync-ok``). The heartbeat's
loss/grad-norm are the last logged values, with ``loss_step`` (the step they belong to); a progress record
before the first log step of a (re)start has none; step/fetch times are host wall clock.
Non-finite steps never change the weights (see nsa/train/step.py); with ``on_nonfinite=halt`` the loop
stops at the next log step with an ``anomaly`` record (at the step the first non-finite value appeared,
carried on the device by IntervalMeter) and without a checkpoint.

Data position: (epoch, batches consumed in that epoch by each rank, samples seen globally) and, where the
data can seek (parquet shards, in process or through Ray Data), every rank's DataPosition (shard, row
group, offset, packing carry; nsa/data/position.py), all-gathered to rank 0 at checkpoint steps. On
resume each rank continues at its own position without reading the consumed documents again (on W ranks
when the checkpoint has k*W positions: k streams per rank, nsa/train/data_ranks.py); a checkpoint
without positions (older, or a world size that does not divide its own) falls back to starting epoch ``epoch``
again and skipping that many batches, with a one-line note. Each rank reads its own row groups in an
order fixed by (files, shuffle_seed, epoch, rank, world size), so both routes are exact.
"""
from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol

import numpy as np
import torch
from torch import nn

from nsa.config import DETERMINISTIC_ENV, RunConfig, apply_process_env
from nsa.telemetry import Watchdog, layer_stats, make_stall_handler, to_host
from nsa.telemetry.health import gate_violations, thresholds_from_logging
from nsa.train.checkpoint import (CheckpointError, build_state, checkpoint_dir_name, list_checkpoints,
                                  load_checkpoint, restore_training_state, save_checkpoint,
                                  scan_checkpoints)
from nsa.train.batches import BatchStream
from nsa.train.cp import ContextParallel
from nsa.train.data_ranks import MultiStream, rank_streams
from nsa.train.fsdp import shard_model, sharded_state, staging_dir, write_shards
from nsa.train.control import Control, Decision, Faults
from nsa.train.debug_steps import DebugSteps
from nsa.train.precision import Precision, precision_from_config
from nsa.train.reporting import DeviceStepTimer, RunReporter
from nsa.train.schedule import build_optimizer, build_scheduler
from nsa.train.graphed import (GraphedStep, allreduce_mean_grads, broadcast_parameters, close_step,
                               graph_unsupported, host_lr)
from nsa.train.step import eval_loss, train_step

log = logging.getLogger(__name__)


class LoopEnv(Protocol):
    rank: int
    world_size: int
    device: torch.device

    def prepare_model(self, model: nn.Module, ddp: bool = True) -> nn.Module: ...  # ddp=False: move only
    def train_batches(self, epoch: int) -> Iterator[torch.Tensor]: ...   # one pass, [b, T+1] int64 on device
    # optional: ``train_stream(epoch, start: DataPosition | None)`` -> an iterable of the same batches with
    # ``position()``, or None when the data cannot seek (nsa/data/position.py)
    def val_batches(self, n: int) -> list[torch.Tensor]: ...
    def resume_state(self) -> Optional[dict[str, Any]]: ...              # latest checkpoint of this run
    def report(self, metrics: dict[str, Any], ckpt_dir: Optional[Path], dir_name: Optional[str]) -> None: ...


# ---------------------------------------------------------------------------------------------- metrics
class IntervalMeter:
    """Device-side sums between log steps; ``flush`` is the one host transfer of a log step.

    ``first_bad`` (0-dim float on the device, -1 = none) keeps the step number of the interval's first
    non-finite step: set by a ``where`` on the device from the step's ``finite`` flag, so the step a NaN
    happened at is known at the next log step without a sync in between."""

    def __init__(self, device: torch.device) -> None:
        z = lambda dt=torch.float32: torch.zeros((), dtype=dt, device=device)  # noqa: E731
        self.loss_sum, self.n_finite, self.nonfinite_total = z(), z(), z()
        self.last_loss, self.last_gn = z(), z()
        self.first_bad = torch.full((), -1.0, device=device)
        self.steps = 0

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor, finite: torch.Tensor, step: int = -1) -> None:
        self.loss_sum += torch.where(finite, loss, torch.zeros_like(loss))
        self.n_finite += finite.float()
        self.nonfinite_total += (~finite).float()
        first = (~finite) & (self.first_bad < 0)
        self.first_bad = torch.where(first, torch.full_like(self.first_bad, float(step)), self.first_bad)
        self.last_loss, self.last_gn = loss, grad_norm
        self.steps += 1

    def flush(self) -> dict[str, float]:
        v = torch.stack([self.loss_sum, self.n_finite, self.nonfinite_total, self.last_loss, self.last_gn,
                         self.first_bad])
        loss_sum, n_finite, nonfinite, last_loss, last_gn, first_bad = v.cpu().tolist()  # sync-ok: log step
        self.loss_sum.zero_()
        self.n_finite.zero_()
        self.first_bad.fill_(-1.0)
        self.steps = 0
        mean = loss_sum / n_finite if n_finite else math.nan
        return {"loss": mean, "loss_last": last_loss, "grad_norm": last_gn, "nonfinite_total": nonfinite,
                "first_nonfinite_step": int(first_bad)}


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _kernel_policy(cfg: RunConfig, device: torch.device, prec: Precision, probed: list) -> str:
    """The policy line for env.json: an NSA model's policies as probed at model build (so a probe's
    fallback shows) and, on the Triton kernels, the route of one layer's call at train.seq_len
    (nsa/ops/plan.py's line); a dense model's dense-kernel choice (flash-attn probes run only for dense models)."""
    try:
        if probed:
            from nsa.ops.flash import branch_summary
            line = "; ".join(sorted({str(p) for p in probed}))
            if any(p.backend == "triton" for p in probed):
                line += "; " + branch_summary(device, prec.dtype or torch.float32, cfg.model.d_k,
                                              cfg.nsa.allow_flash_attn, probed[0].tuning.flash)
                line += "; " + _plan_line(cfg, device, prec, probed[0].tuning)
            return line
        from nsa.ops import KernelPolicy
        dense = cfg.model.attention == "dense"
        return str(KernelPolicy.resolve(device, prec.dtype or torch.float32, cfg.nsa.backend,
                                        allow_flash=cfg.nsa.allow_flash_attn,
                                        head_dim=cfg.model.d_k if dense else None))
    except Exception as exc:  # describing the policy must never stop training
        return f"unavailable: {exc}"


def _plan_line(cfg: RunConfig, device: torch.device, prec: Precision, tuning) -> str:
    """The op's route for one layer of this model at train.seq_len (a training call, B = 1 per layer call)."""
    from nsa.ops.plan import plan_for
    m, n = cfg.model, cfg.nsa
    return plan_for(device, prec.dtype or torch.float32, B=1, T=cfg.train.seq_len, HQ=m.n_heads, H=m.n_kv_groups,
                    d_k=m.d_k, d_v=m.d_v, l=n.l, d=n.d, l_sel=n.l_sel, n_sel=n.n_sel, w=n.w, tuning=tuning).line()


def _fallbacks() -> dict[str, int]:
    try:
        from nsa.ops import fallback_counts
        return dict(fallback_counts())
    except Exception:
        return {}


def _resume_state(env: LoopEnv, run_dir: Path, resume_from: Optional[str]
                  ) -> tuple[Optional[dict[str, Any]], Optional[str], list[str]]:
    """(state, where it came from, skipped): the newest complete, loadable checkpoint of this run, else
    ``resume_from``; ``skipped`` says which newer checkpoint directories were passed over and why.

    Ray registers a reported checkpoint only when its controller next polls the workers (every ~2 s), so
    a worker group that dies right after a report is restarted with the previous one although the newer
    checkpoint is complete on disk. The run dir is ours, so the newest complete checkpoint there that
    loads wins; a partial copy (full disk, killed mid-write) is skipped with its reason; Ray's choice is
    the floor, unless it fails to load itself."""
    skipped: list[str] = []
    try:
        state = env.resume_state()
    except CheckpointError as e:
        skipped.append(f"Ray's latest checkpoint: {e}")
        state = None
    source = "ray" if state is not None else None
    floor = int(state["step"]) if state is not None else -1
    good, partial = scan_checkpoints(run_dir)
    for d, why in partial:
        skipped.append(f"{d.name}: {why}")
    for step, d in reversed(good):
        if step <= floor:
            break
        try:
            return load_checkpoint(d, full_model=False), f"run dir ({d.name})", skipped
        except CheckpointError as e:
            skipped.append(f"{d.name}: {e}")
    if state is None and resume_from:
        return load_checkpoint(resume_from, full_model=False), str(resume_from), skipped
    return state, source, skipped


# ---------------------------------------------------------------------------------------------- loop
class Trainer:
    """State of one worker's run. ``run()`` returns the summary written to metrics.json."""

    def __init__(self, cfg: RunConfig, run_dir: Path, env: LoopEnv, *, mlflow_uri: Optional[str] = None,
                 resume_from: Optional[str] = None) -> None:
        self.cfg, self.run_dir, self.env = cfg, Path(run_dir), env
        self.rank, self.world, self.device = env.rank, env.world_size, env.device
        t, r = cfg.train, cfg.runtime
        self.t0 = time.time()
        _seed_all(r.seed)                                   # identical init on every rank
        if r.detect_anomaly:
            torch.autograd.set_detect_anomaly(True)
        if r.deterministic:   # cuBLAS reads its workspace setting at first use, which comes after this
            apply_process_env(DETERMINISTIC_ENV)
            torch.use_deterministic_algorithms(True)
        self.prec = precision_from_config(r, self.device)
        from nsa.model import TinyLM
        from nsa.ops.dispatch import probe_model
        model = TinyLM.from_config(cfg.model, cfg.nsa).to(self.device)
        self.policies = probe_model(model, self.device, self.prec.dtype or torch.float32)  # kernels tried once (nsa/ops/probe.py)
        self.fsdp = r.sharding == "fsdp"
        if self.fsdp:   # sharded before AdamW is built, so its state lives on the shards (nsa/train/fsdp.py)
            model = shard_model(env.prepare_model(model, ddp=False), self.device, self.prec.dtype)
        self.cp = ContextParallel(r.context_parallel, self.rank, self.world, t.seq_len, self.device)
        self.cp.enter(model)
        self.dp = self.cp.dp      # data-parallel replicas: the streams and global-batch counts are theirs
        self.opt = build_optimizer(model, t)
        self.sched = build_scheduler(self.opt, t)
        state, self.resumed_from, self.skipped_checkpoints = _resume_state(env, self.run_dir, resume_from)
        for why in self.skipped_checkpoints:
            log.warning("resume: skipped %s", why)
        self.step, pos = 0, {"epoch": 0, "batches_in_epoch": 0, "samples_seen": 0}
        self.seek, self.seek_note = None, None     # this rank's recorded DataPositions / why there are none
        if state is not None:
            self.step = restore_training_state(state, model=model, optimizer=self.opt, scheduler=self.sched,
                                               scaler=self.prec.scaler)
            pos = state["data"]
            if getattr(env, "seekable", False):
                groups, self.seek_note = rank_streams(pos, self.dp)   # one stream per replica, or k on fewer
                self.seek = groups[self.cp.dp_rank] if groups is not None else None
            del state
        self.start_step = self.step
        _seed_all(r.seed + 1000 * self.rank + self.step)    # per-rank streams after (re)start
        self.graphed: Optional[GraphedStep] = None
        self.step_mode = "eager"
        why = ((self.cp.graph_reason() or graph_unsupported(model, self.opt, self.prec, self.device,
                                                            sharding=r.sharding)) if r.cuda_graph else "off")
        if why is None:
            # data parallel without DDP (its hooks cannot be captured): same start, grads averaged in-graph
            self.model = env.prepare_model(model, ddp=False)
            sync = None
            if self.world > 1:
                broadcast_parameters(self.model)
                sync = allreduce_mean_grads
            self.graphed = GraphedStep(self.model, self.opt, self.sched, self.prec, grad_clip=t.grad_clip,
                                       device=self.device, warmup=r.cuda_graph_warmup, grad_sync=sync)
            self.step_mode = f"cuda_graph (after {r.cuda_graph_warmup} eager steps)"
        else:
            self.model = model if self.fsdp else env.prepare_model(model)
            if r.cuda_graph:
                self.step_mode = f"eager (runtime.cuda_graph: {why})"
                log.warning("runtime.cuda_graph=true but the step stays eager: %s", why)
        self.core = _unwrap(self.model)
        denv = self.cp.data_env(env)      # under CP: this replica's stream
        if self.seek is not None and len(self.seek) > 1:     # this rank continues k ranks' streams
            self.data: Any = MultiStream(env, self.cp.dp_rank, self.seek, self.dp * len(self.seek))
        elif self.seek is not None:     # continue at this rank's own position: nothing is read twice
            self.data = BatchStream(denv, self.seek[0].epoch, 0, seek=self.seek[0])
        else:
            self.data = BatchStream(denv, pos["epoch"], pos["batches_in_epoch"])
        self.data.samples = pos["samples_seen"] // max(1, self.dp)
        self.data = self.cp.wrap_stream(self.data, env)
        self.saved = {s for s, _ in list_checkpoints(self.run_dir)}   # never overwrite any of these
        self.saved.add(self.step)
        self.rep = RunReporter(cfg, self.run_dir, self.rank, self.world, self.device, mlflow_uri=mlflow_uri,
                               resume_step=self.step if self.resumed_from else None)
        self.ctl = Control(self.run_dir, self.rank, self.world, self.device)
        self.faults = Faults(r.fault, self.run_dir, self.rank, self.world)
        # logging.trace_steps / memory_snapshot_steps: no-ops unless set (their syncs are those steps' only)
        self.debug = DebugSteps(cfg.logging, self.core, self.opt, self.device, self.run_dir, self.rank,
                                self.rep.train_log.log_artifact, start_step=self.step)
        self.meter = IntervalMeter(self.device)
        self.timer = DeviceStepTimer(self.device)
        # periods of warm-up / capture steps are not steady-state step times
        self.steady_from = self.step + 2 + (r.cuda_graph_warmup + 1 if self.graphed is not None else 0)
        self.last: dict[str, float] = {"loss": math.nan, "grad_norm": math.nan, "val_loss": math.nan}
        self.loss_step: Optional[int] = None     # the step self.last's loss/grad norm were read at
        self.first_loss = math.nan
        self.health_seen: list[str] = []     # gate health warnings last printed (print on change only)
        self.nonfinite_seen = 0.0
        self.first_nonfinite_step: Optional[int] = None
        self.tokens = 0
        self.checkpoints: list[int] = []
        self.lr_used = host_lr(self.sched)
        self.first_ms: dict[str, float] = {}

    # ------------------------------------------------------------------ helpers
    def _hb_due(self, step: int) -> bool:
        every = self.cfg.logging.heartbeat_every
        return every == 1 or step % every == 0 or step == 1 or step == self.cfg.train.steps

    def _logged(self) -> dict[str, Any]:
        """Heartbeat fields of the last logged loss. The step's own loss is still on the device when the
        progress record is written (read only at log steps), so before the first log there is no value:
        the fields are left out rather than a NaN that reads as a diverged run."""
        if self.loss_step is None:
            return {}
        return {"loss": self.last["loss"], "grad_norm": self.last["grad_norm"], "loss_step": self.loss_step}

    def _lr(self) -> float:
        """The lr the current/last step used (captured before the scheduler advanced)."""
        return self.lr_used

    def _save(self, step: int, reason: str) -> None:
        """Rank 0 writes the checkpoint to a temp dir (fsdp: every rank its shard, in the run dir); every rank
        calls report (Ray's barrier)."""
        metrics = {"step": step, "loss": self.last["loss"], "val_loss": self.last["val_loss"],
                   "checkpoint_reason": reason}
        name = checkpoint_dir_name(step)
        t0 = time.perf_counter()
        ranks = self._gather_positions()     # every rank: a collective at checkpoint steps (sync-ok)
        state = None
        if self.rank == 0:
            data = {**self.data.position(self.dp), **({"ranks": ranks} if ranks else {})}
            state = build_state(model=self.core, optimizer=self.opt, scheduler=self.sched,
                                scaler=self.prec.scaler, step=step, data=data,
                                config=self.cfg.to_dict(), metrics={k: v for k, v in self.last.items()})
        if self.fsdp:       # every rank writes its shard into the run dir; the report renames it into place
            stage = staging_dir(self.run_dir, name)
            files = write_shards(stage, self.core, self.opt, self.rank, self._barrier)
            if state is not None and files is not None:
                save_checkpoint(stage, sharded_state(state, files), extra_files=files)
            del state
            self.env.report(metrics, stage if self.rank == 0 else None, name)
        elif self.rank == 0:
            with tempfile.TemporaryDirectory(prefix="nsa_ckpt_") as d:
                save_checkpoint(d, state)
                del state
                self.env.report(metrics, Path(d), name)
        else:
            self.env.report(metrics, None, name)
        self.saved.add(step)
        self.checkpoints.append(step)
        self.rep.heartbeat("checkpoint", step, reason=reason, dir=name,
                           seconds=round(time.perf_counter() - t0, 3))

    def _barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier(group=self.ctl.cpu_group)

    def _gather_positions(self) -> Optional[list[Any]]:
        """Every rank's DataPosition (host objects, all-gathered over the CPU group), or None when the
        data cannot seek. Called by every rank at the same checkpoint steps."""
        if not getattr(self.env, "seekable", False):
            return None
        mine = self.data.rank_position()
        out: list[Any] = [mine]
        if self.world > 1:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                return None
            out = [None] * self.world
            torch.distributed.all_gather_object(out, mine, group=self.ctl.cpu_group)
        out = self.cp.streams(out)       # one position per replica (its CP group's first rank)
        if any(p is None for p in out):
            return None
        return [q for p in out for q in (p if isinstance(p, list) else [p])]   # k streams per rank: in order

    def _log(self, step: int, res_tokens: int, extra: dict[str, float]) -> dict[str, float]:
        host = self.meter.flush()
        self.last["loss"], self.last["grad_norm"] = host["loss"], host["grad_norm"]
        self.loss_step = step
        if math.isnan(self.first_loss):
            self.first_loss = host["loss"]
        new_bad = host["nonfinite_total"] - self.nonfinite_seen
        self.nonfinite_seen = host["nonfinite_total"]
        mem = self.rep.memory()
        tim = self.rep.timing_fields()
        metrics = {"loss": host["loss"], "lr": self._lr(), "grad_norm": host["grad_norm"],
                   "toks_per_s": res_tokens * self.dp / max(1e-9, self._typical_step_ms() / 1e3),
                   "step_ms": tim["step_ms_p50"], "step_ms_p95": tim["step_ms_p95"],
                   "fetch_ms_p50": tim["fetch_ms_p50"], "fetch_ms_p95": tim["fetch_ms_p95"],
                   "mem_mib": mem["mem_mib"], "nonfinite_steps": host["nonfinite_total"],
                   "epoch": self.data.epoch, **extra}
        self.rep.log_train(metrics, step)
        if new_bad > 0:
            bad_at = host["first_nonfinite_step"] if host["first_nonfinite_step"] > 0 else step
            self.first_nonfinite_step = self.first_nonfinite_step or bad_at
            self.rep.heartbeat("anomaly", bad_at, what="non-finite loss or grad norm", new_nonfinite_steps=new_bad,
                               detected_at=step, loss_last=host["loss_last"], grad_norm=host["grad_norm"],
                               policy=self.cfg.train.on_nonfinite)
            if self.rank == 0:
                print(f"non-finite loss or grad norm at step {bad_at} ({int(new_bad)} step(s) since the last log; "
                      f"train.on_nonfinite={self.cfg.train.on_nonfinite})", flush=True)
            if self.cfg.train.on_nonfinite == "halt":
                self.ctl.request_anomaly_halt()
        if self.rank == 0:
            print(self._progress_line(step, metrics, extra), flush=True)
        return metrics

    def _progress_line(self, step: int, m: dict[str, float], extra: dict[str, float]) -> str:
        tim = self.rep.timing_fields()
        if math.isfinite(tim["step_ms_p50"]):
            times = (f"step {tim['step_ms_p50']:.0f}ms (p95 {tim['step_ms_p95']:.0f}) | "
                     f"fetch {tim['fetch_ms_p50']:.1f}ms (p95 {tim['fetch_ms_p95']:.1f})")
        else:   # only the warm-up step so far
            times = (f"first step {self.first_ms.get('first_step_ms', math.nan):.0f}ms "
                     f"(fetch {self.first_ms.get('first_fetch_ms', math.nan):.0f}ms)")
        val = f" | val {extra['val_loss']:.4f}" if "val_loss" in extra else ""
        return (f"step {step}/{self.cfg.train.steps} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | "
                f"{m['toks_per_s']:.0f} tok/s | {times} | gnorm {m['grad_norm']:.3f} | mem {m['mem_mib']:.0f}MiB{val}")

    def _typical_step_ms(self) -> float:
        p50 = self.rep.step_ms.p50
        return p50 if math.isfinite(p50) else self.first_ms.get("first_step_ms", math.nan)

    def _stats(self) -> dict[str, float]:
        stats = layer_stats(self.core, l_sel=self.cfg.nsa.l_sel, positions=self.cp.positions)   # CP: this rank's rows
        host = to_host(stats) if stats else {}  # sync-ok: every logging.stats_every steps
        self.core.set_record_stats(False)
        return host

    def _eval(self, val: list[torch.Tensor]) -> float:
        v = eval_loss(self.model, val, self.prec, self.cp)
        return float(v)  # sync-ok: eval steps only

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        self.rep.write_env(_kernel_policy(cfg, self.device, self.prec, self.policies))
        self.rep.heartbeat("start", self.step, world_size=self.world, device=str(self.device),
                           resumed_from=self.resumed_from, skipped_checkpoints=self.skipped_checkpoints,
                           precision=self.prec.name,
                           data_position=self.data.position(self.dp),
                           **({"data_seek": self.seek[0].describe(), "data_streams": len(self.seek)}
                              if self.seek is not None else {}))
        if self.rank == 0:
            if self.seek_note:
                print(self.seek_note, flush=True)
            for why in self.skipped_checkpoints:
                print(f"resume: skipped {why}", flush=True)
            print(self.prec.describe() + f"; world_size={self.world}; sharding={cfg.runtime.sharding}; "
                  f"context_parallel={self.cp.size}; "
                  f"step: {self.step_mode}; start step {self.step}"
                  + (f" (from {self.resumed_from})" if self.resumed_from else ""), flush=True)
        val = self.env.val_batches(t.eval_batches) if t.eval_batches > 0 else []
        # on_stall=restart/halt end a stuck worker after the record (see make_stall_handler)
        wd = self.wd = Watchdog(t.stall_seconds, make_stall_handler(
            self.run_dir, self.rep.hb, lambda: self.step, action=t.on_stall,
            is_stalled=lambda: self.wd.stalled, grace_seconds=t.stall_seconds)).start()
        status, reason = "completed", ""
        try:
            status, reason = self._steps(val)
        except BaseException as exc:
            self.rep.heartbeat("halt", self.step, status="failed", error=f"{type(exc).__name__}: {exc}"[:500])
            self.rep.finish(self._summary("failed", str(exc)[:500], wd), "FAILED")
            raise
        finally:
            wd.stop()
            self.ctl.close()
            close_step(self.graphed)
            self.data.close()
            self.debug.close()
            self.cp.close()
        summary = self._summary(status, reason, wd)
        self.rep.heartbeat("end", self.step, status=status, reason=reason)
        self.rep.finish(summary, "FINISHED" if status in ("completed", "halted", "terminated") else "FAILED")
        return summary

    def _steps(self, val: list[torch.Tensor]) -> tuple[str, str]:
        t, lg = self.cfg.train, self.cfg.logging
        total, status, reason = t.steps, "completed", ""
        tokens_step = 0
        while self.step < total:
            step = self.step + 1
            t_start = time.perf_counter()
            hb = self._hb_due(step)
            if hb:
                self.rep.heartbeat("step_start", step)
            poison = self.faults.before_step(step, t.stall_seconds, sys.stdout.flush)
            # the first step after (re)start pays data pipeline start-up, allocator warm-up and kernel
            # JIT/autotuning (minutes for Triton on a cold cache): not a stall, so the watchdog pauses
            with self.wd.paused() if step == self.start_step + 1 else contextlib.nullcontext():
                micro, fetch_s = self.data.next(t.accumulate)
                stats_due = lg.stats_every > 0 and step % lg.stats_every == 0
                self.core.set_record_stats(stats_due)
                self.lr_used = host_lr(self.sched)
                traced = self.debug.before(step)   # hooks fire only in eager steps
                if self.graphed is not None:   # stats steps run eagerly: the graph records no stats
                    res = self.graphed(micro, poison=poison, eager=stats_due or traced)
                else:
                    res = train_step(self.model, micro, self.opt, self.sched, self.prec, grad_clip=t.grad_clip,
                                     poison=poison, cp=self.cp)
                self.debug.after(step, res)
            self.step = step
            tokens_step = res.tokens
            self.tokens += res.tokens * self.dp
            self.meter.add(res.loss, res.grad_norm, res.finite, step)
            self.timer.mark(step)
            step_ms = (time.perf_counter() - t_start) * 1e3
            if step > self.start_step + 1:      # the first step after (re)start pays data/model warm-up:
                if not self.timer.enabled:      # reported once as first_step_ms/first_fetch_ms, kept out
                    self.rep.step_ms.add(step_ms)   # of the rolling p50/p95
                self.rep.fetch_ms.add(fetch_s * 1e3)
            else:
                self.first_ms = {"first_step_ms": step_ms, "first_fetch_ms": fetch_s * 1e3}
            for s_done, ms in self.timer.drain():   # CUDA: device step periods (host may run ahead)
                if s_done >= self.steady_from:
                    self.rep.step_ms.add(ms)
            dev_ms = {"gpu_step_ms": round(self.timer.latest_ms, 3)} if math.isfinite(self.timer.latest_ms) else {}
            if hb:
                self.rep.heartbeat("progress", step, **self._logged(), lr=self._lr(), step_ms=round(step_ms, 3),
                                   fetch_ms=round(fetch_s * 1e3, 3),
                                   toks_per_s=res.tokens * self.dp / max(1e-9, dev_ms.get("gpu_step_ms", step_ms) / 1e3),
                                   **dev_ms,
                                   **self.rep.timing_fields(), **self.rep.memory())
            dec = self._end_of_step(step, val, tokens_step, stats_due)
            if hb:
                self.rep.heartbeat("step_end", step, **self._logged(), lr=self._lr(),
                                   step_ms=round((time.perf_counter() - t_start) * 1e3, 3),
                                   compute_ms=round(step_ms - fetch_s * 1e3, 3), fetch_ms=round(fetch_s * 1e3, 3),
                                   **dev_ms,
                                   **self.rep.timing_fields(), **self.rep.memory(), fallbacks=_fallbacks())
            self.wd.kick()
            if dec.stop:
                status = "anomaly" if dec.anomaly else ("terminated" if dec.terminate else "halted")
                reason = (f"non-finite loss at step {self.first_nonfinite_step} (train.on_nonfinite=halt)"
                          if dec.anomaly and self.first_nonfinite_step else
                          "non-finite loss (train.on_nonfinite=halt)" if dec.anomaly
                          else (self.ctl.stop_reason or "halt requested on another rank"))
                self.rep.heartbeat("halt", step, status=status, reason=reason,
                                   checkpoint=None if dec.anomaly else checkpoint_dir_name(step))
                if self.rank == 0:
                    print(f"stopping at step {step}: {status} ({reason})", flush=True)
                break
        return status, reason

    def _end_of_step(self, step: int, val: list[torch.Tensor], tokens_step: int, stats_due: bool) -> Decision:
        t, lg = self.cfg.train, self.cfg.logging
        final = step == t.steps
        eval_due = bool(val) and ((t.eval_every > 0 and step % t.eval_every == 0) or final)
        log_due = step % lg.log_every == 0 or final or eval_due or self.step == self.start_step + 1
        extra: dict[str, float] = {}
        if stats_due:
            stats = self._stats()
            extra.update(stats)
            warn = gate_violations(stats, thresholds_from_logging(lg))
            self.rep.heartbeat("progress", step, stats=stats, **({"health_warnings": warn} if warn else {}))
            keys = [w.split("=")[0] for w in warn]    # which (layer, stat) rules, not their values
            if warn and self.rank == 0 and keys != self.health_seen:   # a line when that set changes
                print(f"gate health warning at step {step}: {'; '.join(warn)}", flush=True)
            self.health_seen = keys
        if eval_due:
            self.last["val_loss"] = self._eval(val)
            extra["val_loss"] = self.last["val_loss"]
            self.rep.log_val({"val_loss": self.last["val_loss"],
                              "val_ppl": math.exp(min(self.last["val_loss"], 50.0))}, step)
            self.rep.heartbeat("eval", step, val_loss=self.last["val_loss"])
        if log_due:
            self._log(step, tokens_step, extra)
        if stats_due or eval_due:
            self.timer.gap()
        fired = self.faults.armed and self.faults.kind == "halt" and step == self.faults.at
        self.faults.after_step(step)
        dec = self.ctl.decide(force_poll=fired or final)
        if step not in self.saved and not dec.anomaly:
            why = ("final" if final else "save_every" if t.save_every and step % t.save_every == 0 else
                   "halt" if dec.halt else "terminate" if dec.terminate else "request" if dec.checkpoint else "")
            if why:
                self._save(step, why)
                self.timer.gap()
                return dec
        if eval_due:
            self.env.report({"step": step, "loss": self.last["loss"], "val_loss": self.last["val_loss"]}, None, None)
        return dec

    def _summary(self, status: str, reason: str, wd: Watchdog) -> dict[str, Any]:
        wall = time.time() - self.t0
        tim = self.rep.timing_fields()
        return {
            "status": status, "reason": reason, "run_dir": str(self.run_dir), "step": self.step,
            "total_steps": self.cfg.train.steps, "start_step": self.start_step, "resumed_from": self.resumed_from,
            "final_loss": self.last["loss"], "first_logged_loss": self.first_loss,
            "final_val_loss": self.last["val_loss"], "final_grad_norm": self.last["grad_norm"],
            "nonfinite_steps": self.nonfinite_seen, "first_nonfinite_step": self.first_nonfinite_step,
            "tokens_seen_this_session": self.tokens,
            "wall_s": wall, "toks_per_s": self.tokens / wall if wall > 0 else math.nan, **tim,
            **self.first_ms, "stalls": wd.stall_count, "checkpoints": self.checkpoints, "world_size": self.world,
            "data_position": self.data.position(self.dp), "mlflow_run_id": self.rep.mlflow_run_id,
            "fallbacks": _fallbacks(), "precision": self.prec.name, "device": str(self.device),
            "step_mode": self.step_mode, "sharding": self.cfg.runtime.sharding, "context_parallel": self.cp.size,
            "graph_replays": self.graphed.replays if self.graphed is not None else 0,
        }


def run_training(cfg: RunConfig, run_dir: str | Path, env: LoopEnv, *, mlflow_uri: Optional[str] = None,
                 resume_from: Optional[str] = None) -> dict[str, Any]:
    """Train one worker's share; returns the summary (also written to metrics.json by rank 0)."""
    return Trainer(cfg, Path(run_dir), env, mlflow_uri=mlflow_uri, resume_from=resume_from).run()
