"""When the driver that started a private Ray instance dies, the instance goes with it, within a second.

Seen on Ray 2.60 (Linux, tiny CPU run) after ``kill -9 <driver>``: gcs_server and the raylet die at once (Ray
ties them to the driver with PR_SET_PDEATHSIG), the train workers notice the raylet is gone only seconds later,
after another step and checkpoint, and the dashboard and runtime-env agents linger for about a minute. The
driver's process tree is no help afterwards: those processes are reparented to init as their parents die,
and the actors sit in process groups of their own.

What marks them instead: the environment every process of the instance inherits from the driver's
``ray.init``, where the driver puts ``_NSA_RAY_OWNER=<pid>:<start ticks>:<nonce>`` for that call only, and,
for the agents (whose copy of it Ray's process renaming zeroes), their open log files in the instance's
session folder (``Instance``). The driver starts this file as a small stdlib-only process (its own session,
so a terminal's Ctrl-C or hang-up does not reach it) that waits on pidfds of the driver, gcs_server and the
raylet; when any of them ends it SIGKILLs every member, rescans until none is left, and exits. A cluster the
driver merely joins (``ray job submit``, ``runtime.ray_address``) never gets a marker or a reaper. The train
workers read the same marker to stop at their next step boundary once the driver is gone (``Liveness``,
polled by nsa/train/control.py).

    python -I nsa/launch/reaper.py <NAME=marker> <session dir> <watched pid:start> ...   (``start_reaper``)
"""
from __future__ import annotations

import os
import secrets
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

SWEEP_S = 10.0        # give up rescanning after this long (a process that cannot be killed)
REASON_WAIT_S = 3.0   # how long the log line waits to tell a dead driver from an instance that died alone


def start_ticks(pid: int) -> Optional[str]:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot): with the pid it names one process
    for good, where a pid alone may be reused. None when the process is gone or /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()    # after "(comm)", which may hold spaces
    return fields[19].decode() if len(fields) > 19 else None


def new_marker(pid: Optional[int] = None) -> str:
    """``<pid>:<start ticks>:<nonce>`` of this process: one per instance it starts (a driver may start several)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_ticks(pid)}:{secrets.token_hex(4)}"


class Liveness:
    """Whether the process named by ``<pid>:<start ticks>[:...]`` still runs. A pidfd (opened once, then one
    non-blocking poll per ``gone()``) cannot be fooled by pid reuse; without pidfds: ``kill(pid, 0)`` plus
    the start ticks."""

    def __init__(self, token: str) -> None:
        pid, ticks = token.split(":")[:2]
        self.pid, self.ticks = int(pid), ticks
        self._fd: Optional[int] = None
        self._dead = False
        try:
            self._fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            self._dead = True
        except (AttributeError, OSError):       # not Linux >= 5.3: the fallback below
            pass
        if not self._dead and self._reused():   # the pid is another process's already
            self._dead = True

    def _reused(self) -> bool:
        now = start_ticks(self.pid)
        return now is not None and self.ticks != "None" and now != self.ticks

    def fileno(self) -> Optional[int]:
        return self._fd

    def gone(self) -> bool:
        if self._dead:
            return True
        if self._fd is not None:
            self._dead = bool(select.select([self._fd], [], [], 0)[0])   # readable once the process exited
        else:
            try:
                os.kill(self.pid, 0)
                self._dead = self._reused()
            except ProcessLookupError:
                self._dead = True
            except PermissionError:
                pass
        return self._dead

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Instance:
    """The processes of one private instance: those whose initial environment holds ``needle``
    (``NAME=marker``: gcs, raylet, Ray's Python helpers, workers), and those named ``ray::...`` that hold a
    file of the instance's session folder open (its log files; the agents, whose environment Ray's process
    renaming overwrites with zeros). Another instance's processes have their own session folder and marker;
    a user's ``tail -f`` on a log file is not ``ray::``."""

    def __init__(self, needle: str, session_dir: str) -> None:
        self.needle = needle.encode()
        self.prefix = os.path.realpath(session_dir) + "/"

    def member(self, pid: int | str) -> bool:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if self.needle in f.read().split(b"\0"):
                    return True
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read(5) != b"ray::":
                    return False
            fds = f"/proc/{pid}/fd"
            return any(os.readlink(f"{fds}/{fd}").startswith(self.prefix) for fd in os.listdir(fds))
        except OSError:             # gone, or another user's
            return False

    def members(self) -> list[int]:
        return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != os.getpid() and self.member(n)]

    def sweep(self) -> int:
        """SIGKILL every member until a scan finds none; how many. Each is signalled through a pidfd opened
        before a second look at it, so a pid reused since the scan is never hit."""
        killed: set[int] = set()
        deadline = time.monotonic() + SWEEP_S
        while time.monotonic() < deadline:
            pids = self.members()
            if not pids:
                break
            for pid in pids:
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    continue
                try:
                    if self.member(pid):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                        killed.add(pid)
                except OSError:
                    pass
                finally:
                    os.close(fd)
            time.sleep(0.05)        # let the kills land (and a fork in flight show up) before the next scan
        return len(killed)


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and Path("/proc/self/environ").exists()


def start_reaper(needle: str, session_dir: str, watched: list[str],
                 log_file: Optional[str] = None) -> Optional[subprocess.Popen]:
    """Start the reaper of the ``Instance(needle, session_dir)``; it acts when the driver (the marker's pid) or
    any ``watched`` ``pid:start`` ends. None where unsupported."""
    if not supported():
        return None
    err = open(log_file, "ab") if log_file else subprocess.DEVNULL
    try:
        # no pipe of the driver's: a caller reading the driver's output to EOF must not wait for the reaper
        return subprocess.Popen([sys.executable, "-I", __file__, needle, session_dir, *watched],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True, cwd="/")
    finally:
        if log_file:
            err.close()


def main(argv: list[str]) -> int:
    for name in ("SIGINT", "SIGHUP", "SIGPIPE"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    needle, session_dir, watched = argv[0], argv[1], argv[2:]
    driver_token = needle.partition("=")[2]
    watches = [Liveness(t) for t in [driver_token, *watched]]
    poll = select.poll()
    for w in watches:
        if w.fileno() is not None:
            poll.register(w.fileno(), select.POLLIN)
    while not any(w.gone() for w in watches):
        poll.poll(None if all(w.fileno() is not None for w in watches) else 500)
    n = Instance(needle, session_dir).sweep()
    # after the sweep, and then up to REASON_WAIT_S more: a dying driver's children get their death signal before
    # its own pidfd reports it (a large process takes a while to tear down its address space, longer under load)
    until = time.monotonic() + REASON_WAIT_S
    while not watches[0].gone() and time.monotonic() < until:
        time.sleep(0.05)
    why = "its driver ended" if watches[0].gone() else "the instance ended"
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} nsa reaper: {why}; killed {n} leftover process(es) of "
          f"{needle}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
