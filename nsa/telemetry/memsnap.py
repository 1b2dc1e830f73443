"""A CUDA memory snapshot over the first training steps (config ``logging.memory_snapshot_steps``; it
replaces the runbooks' NSA_MEM_DUMP_EVERY).

    snap = MemorySnapshot(device)            # ValueError (one line, naming the field) off CUDA
    snap.start(); <steps>; paths = snap.dump(out_dir, stem)

``start`` turns on the caching allocator's history (torch.cuda.memory._record_memory_history: every
alloc/free with its Python/C++ stack); ``dump`` writes the pickle that https://pytorch.org/memory_viz
opens, plus two self-contained HTML views made here by torch.cuda._memory_viz: ``trace_plot`` (the
allocations over time) and ``segment_plot`` (the allocator's segments at the end), and stops recording.
Recording costs host time per allocation (no device syncs); it runs only over the snapshot steps.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Optional

import torch

FIELD = "logging.memory_snapshot_steps"


def unavailable(device: torch.device | str) -> Optional[str]:
    """Why a memory snapshot cannot be recorded on ``device`` (None: it can)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (f"{FIELD} records the CUDA caching allocator: this worker runs on {dev.type} "
                f"(set {FIELD}=0, or train on GPUs with runtime.use_gpu=true)")
    if not torch.cuda.is_available():
        return f"{FIELD}: CUDA is not available in this process (set {FIELD}=0)"
    return None


class MemorySnapshot:
    """The allocator history of one CUDA device between ``start`` and ``dump``."""

    def __init__(self, device: torch.device | str, max_entries: int = 200_000) -> None:
        why = unavailable(device)
        if why is not None:
            raise ValueError(why)
        self.device = torch.device(device)
        self.max_entries = int(max_entries)     # bounds the host memory the history keeps
        self.recording = False

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(enabled="all", max_entries=self.max_entries,
                                                 device=self.device)
        self.recording = True

    def stop(self) -> None:
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            self.recording = False

    def dump(self, out_dir: str | Path, stem: str = "memory_snapshot") -> list[Path]:
        """Write ``<stem>.pickle``, ``<stem>_trace.html`` and ``<stem>_segments.html``; stop recording.
        An HTML view that torch cannot draw is left out with a note file; the pickle is always written."""
        from torch.cuda import _memory_viz
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        pkl = out / f"{stem}.pickle"
        try:
            torch.cuda.memory._dump_snapshot(str(pkl))
        finally:
            self.stop()
        paths = [pkl]
        with pkl.open("rb") as f:
            data = pickle.load(f)
        for kind, fn in (("trace", _memory_viz.trace_plot), ("segments", _memory_viz.segment_plot)):
            html = out / f"{stem}_{kind}.html"
            try:
                html.write_text(fn(data, device=self.device.index))
            except Exception as exc:  # noqa: BLE001 - a view must not lose the snapshot itself
                html = out / f"{stem}_{kind}.error.txt"
                html.write_text(f"{kind} view not drawn: {type(exc).__name__}: {exc}\n")
            paths.append(html)
        return paths
