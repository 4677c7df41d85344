"""One sweep at a time per results table: an ``flock`` on ``results/.<sweep>.csv.lock``.

Two sweeps writing the same table would each run the same points, replace each other's records and
mark each other's finished points as errors. The lock file names its holder (pid, host, command, start
time) so the refusal can say who is running; the kernel drops the lock when that process dies, so a
killed sweep never leaves a stale lock behind (the file itself stays, empty of meaning).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path


class SweepBusy(RuntimeError):
    """Another process holds the sweep lock of this results table."""


def lock_path(table: Path) -> Path:
    return table.with_name(f".{table.name}.lock")


class SweepLock:
    """Context manager: hold the lock of ``table`` for the life of a sweep.

    ``wait_s`` = 0 refuses at once when another process holds it; a positive value waits that long
    (polling) before refusing. Raises ``SweepBusy`` naming the other process.
    """

    def __init__(self, table: str | Path, *, wait_s: float = 0.0, poll_s: float = 0.2):
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not wait_s >= 0:
            raise ValueError(f"wait_s must be a number of seconds >= 0, got {wait_s!r}")
        self.table = Path(table)
        self.path = lock_path(self.table)
        self.wait_s, self.poll_s = float(wait_s), poll_s
        self._fd: int | None = None

    def __enter__(self) -> "SweepLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _read_holder(self.path)
                    os.close(fd)
                    waited = f" (waited {self.wait_s:.0f} s)" if self.wait_s else ""
                    raise SweepBusy(
                        f"another sweep is writing {self.table}{waited}: {holder}. Wait for it to finish "
                        f"(or pass --wait SECONDS), or give this sweep another --experiments-dir") from None
                time.sleep(self.poll_s)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:300],
                  "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # nobody holds it now
            os.close(self._fd)  # closing releases the flock
            self._fd = None


def _read_holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "a process that has not said who it is yet"
    return (f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')} "
            f"({info.get('command') or 'unknown command'})")
