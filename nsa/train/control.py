"""Operator control of the per-worker loop, and test-only fault injection.

Requests come from three places and are turned into one set of flags all ranks agree on:

* control files in the run dir (nsa.telemetry.ControlFiles): ``.HALT`` -> checkpoint and stop,
  ``.CHECKPOINT`` -> checkpoint at the next step boundary. Polled by rank 0 only.
* signals sent to a worker process: Ray Train runs the loop in a non-main thread, where Python cannot
  install signal handlers (``signal.signal`` raises; measured: SIGUSR2 is at its default action, which
  kills the process). ``faulthandler.register`` can: it installs a C-level handler from any thread.
  So each signal gets a faulthandler that writes all thread stacks to a per-rank file, and the loop
  checks the size of those files (one ``fstat`` each) at every step boundary:
      SIGUSR1 -> stackdump_sigusr1_rank{r}.txt   (the dump is the point; removed at close if still empty)
      SIGUSR2 -> .signals/signal_sigusr2_rank{r}.txt   grew -> checkpoint request
      SIGTERM -> .signals/signal_sigterm_rank{r}.txt   grew -> checkpoint, then stop
  While the loop runs, SIGTERM no longer kills the worker at once (Ray's own handler is restored when
  the loop ends); a stuck worker needs SIGKILL.
* the loop itself: non-finite loss under ``train.on_nonfinite=halt`` (known at log steps).
* the driver's death, in a private instance (its marker in the environment, nsa/launch/reaper.py): every rank
  polls a pidfd of the driver at each step boundary (one non-blocking syscall) and, once the driver is gone,
  ends its process there, before any checkpoint: nobody is left to register one, and a relaunch resumes
  from the last complete one. A worker of a cluster the driver joined has no marker; Ray ends those jobs.

Agreement: a 4-int CPU tensor [halt, checkpoint, terminate, anomaly] is all-reduced (MAX) every step.
On GPUs this runs on a separate gloo group over CPU tensors, so it never waits for the GPU; its cost is
one small collective per step (~0.1-1 ms), which buys every rank leaving the loop at the same step.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from nsa.config.env import ray_owner
from nsa.launch.reaper import Liveness
from nsa.telemetry import ControlFiles, ControlFlags
from nsa.telemetry.signals import close_dump_file

log = logging.getLogger(__name__)

EXIT_ORPHANED = 3      # a worker's exit status once its driver is gone (1 stays a crash's)
_SIGNALS = (("SIGUSR1", "stackdump_sigusr1"), ("SIGUSR2", "signal_sigusr2"), ("SIGTERM", "signal_sigterm"))


@dataclass
class Decision:
    halt: bool = False          # .HALT: checkpoint then stop
    checkpoint: bool = False    # .CHECKPOINT / SIGUSR2: checkpoint, keep going
    terminate: bool = False     # SIGTERM: checkpoint then stop
    anomaly: bool = False       # non-finite loss under on_nonfinite=halt: stop, no checkpoint

    @property
    def stop(self) -> bool:
        return self.halt or self.terminate or self.anomaly


class SignalFiles:
    """faulthandler-based signal capture usable from any thread (see module doc)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self._files: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self.paths: dict[str, Path] = {}
        for name, stem in _SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            # the SIGUSR1 dump sits beside the other stackdump_*.txt; the request files are bookkeeping
            folder = Path(run_dir) if name == "SIGUSR1" else Path(run_dir) / ".signals"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{stem}_rank{rank}.txt"
            try:
                fh = open(path, "a", encoding="utf-8")
                # all_threads only for the dump that is wanted: walking other threads' frames from a C
                # signal handler while they run (Ray's threads) can crash; one thread's dump is enough
                # to make the file grow, which is all a request needs
                faulthandler.register(signum, file=fh, all_threads=name == "SIGUSR1", chain=False)
            except (OSError, RuntimeError, ValueError) as exc:
                log.warning("%s not captured on rank %d: %s", name, rank, exc)
                continue
            self._files[name], self.paths[name] = fh, path
            self._sizes[name] = os.fstat(fh.fileno()).st_size

    def poll(self) -> set[str]:
        """Names of the signals received since the last poll."""
        got = set()
        for name, fh in self._files.items():
            size = os.fstat(fh.fileno()).st_size
            if size != self._sizes[name]:
                self._sizes[name] = size
                got.add(name)
        return got

    def close(self) -> None:
        for name, fh in self._files.items():
            try:
                faulthandler.unregister(getattr(signal, name))
            finally:
                # an empty SIGUSR1 file means no dump happened: do not leave it in the run dir. The
                # request files stay (hidden bookkeeping whose sizes a restarted worker compares against)
                if name == "SIGUSR1":
                    close_dump_file(fh)
                else:
                    fh.close()
        self._files.clear()


class Control:
    """Collects requests on this rank and agrees on them across ranks (``decide``)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, device: torch.device,
                 *, poll_interval_s: float = 0.5) -> None:
        self.rank, self.world = rank, world_size
        self.files = ControlFiles(run_dir, min_interval_s=poll_interval_s) if rank == 0 else None
        self.flags = ControlFlags()
        self.signals = SignalFiles(run_dir, rank)
        self.anomaly = False
        owner = ray_owner()
        self.driver = Liveness(owner) if owner else None
        self._group = None
        if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            backend = torch.distributed.get_backend()
            # CPU flags: reuse a gloo default group, else a gloo side group (never touch the GPU stream)
            self._group = None if backend == "gloo" else torch.distributed.new_group(backend="gloo")
            self._distributed = True
        else:
            self._distributed = False

    @property
    def cpu_group(self) -> Any:
        """The process group for CPU-object collectives (None: the default group, when it is gloo)."""
        return self._group

    def request_anomaly_halt(self) -> None:
        self.anomaly = True

    def _local(self, force_poll: bool) -> torch.Tensor:
        if self.files is not None:
            self.files.poll(self.flags, force=force_poll)
        got = self.signals.poll()
        if "SIGUSR1" in got:
            log.warning("rank %d: SIGUSR1 stack dump written to %s", self.rank, self.signals.paths["SIGUSR1"])
        if "SIGUSR2" in got:
            self.flags.request_checkpoint()
        if "SIGTERM" in got:
            self.flags.request_stop("SIGTERM")
        halt = self.flags.stop_requested and self.flags.stop_reason != "SIGTERM"
        term = self.flags.stop_requested and self.flags.stop_reason == "SIGTERM"
        ckpt = self.flags.take_checkpoint_request()
        return torch.tensor([int(halt), int(ckpt), int(term), int(self.anomaly)], dtype=torch.int32)

    def decide(self, force_poll: bool = False) -> Decision:
        """Call at every step boundary on every rank (a collective when world_size > 1). Does not return
        once the driver of this worker's private Ray instance is gone (module doc)."""
        if self.driver is not None and self.driver.gone():
            self._orphaned()
        t = self._local(force_poll)
        if self._distributed:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self._group)
        v = t.tolist()  # sync-ok: CPU tensor, no device involved
        return Decision(halt=bool(v[0]), checkpoint=bool(v[1]), terminate=bool(v[2]), anomaly=bool(v[3]))

    def _orphaned(self) -> None:
        print(f"rank {self.rank}: the driver (pid {self.driver.pid}) is gone: this worker ends at the step "
              "boundary without a checkpoint", file=sys.stderr, flush=True)
        os._exit(EXIT_ORPHANED)

    @property
    def stop_reason(self) -> str:
        return self.flags.stop_reason

    def close(self) -> None:
        self.signals.close()
        if self.driver is not None:
            self.driver.close()


class Faults:
    """Test-only fault injection from ``runtime.fault`` ("<kind>@<step>"), each at most once per run dir.

    A marker file ``.fault_<kind>@<step>.done`` records that the fault fired, so a worker group that Ray
    restarts (kill/crash) or a resumed run does not inject it again. Whether it already fired is read
    once, at loop start, so every rank takes the same decision.
      stall@N  rank 0 sleeps past the watchdog (stall_seconds * 1.5 + 1 s) before step N, then goes on
      kill@N   the last rank SIGKILLs its own process before step N (Ray restarts the worker group)
      crash@N  rank 0 raises RuntimeError before step N
      nan@N    every rank multiplies step N's loss by NaN
      halt@N   rank 0 writes run_dir/.HALT after step N (a deterministic operator halt)
    """

    def __init__(self, spec: str, run_dir: Path, rank: int, world_size: int) -> None:
        self.kind, self.at = "", -1
        if spec:
            kind, _, at = spec.partition("@")
            self.kind, self.at = kind, int(at)
        self.rank, self.world, self.run_dir = rank, world_size, Path(run_dir)
        self.marker = self.run_dir / f".fault_{self.kind}@{self.at}.done"
        self.armed = bool(self.kind) and not self.marker.exists()

    def _fire(self) -> None:
        self.armed = False
        self.marker.write_text(f"fired at {time.time()} by rank {self.rank} pid {os.getpid()}\n")

    def before_step(self, step: int, stall_seconds: float, flush: Callable[[], None]) -> bool:
        """Run the fault due before ``step``. Returns True if this step's loss must be poisoned."""
        if not self.armed or step != self.at:
            return False
        if self.kind == "nan":
            if self.rank == 0:
                self._fire()
            return True
        if self.kind == "stall" and self.rank == 0:
            self._fire()
            time.sleep(stall_seconds * 1.5 + 1.0)
        elif self.kind == "kill" and self.rank == self.world - 1:
            self._fire()
            flush()
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "crash" and self.rank == 0:
            self._fire()
            raise RuntimeError(f"injected crash at step {step} (runtime.fault=crash@{self.at})")
        return False

    def after_step(self, step: int) -> None:
        if self.armed and self.kind == "halt" and step == self.at and self.rank == 0:
            self._fire()
            (self.run_dir / ControlFiles.HALT).write_text(f"injected by runtime.fault=halt@{self.at}\n")

