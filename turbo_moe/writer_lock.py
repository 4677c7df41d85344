"""A lock file that names its holder: one writer at a time for a results table or a checkpoint folder.

The kernel drops an ``flock`` when its process dies, so a killed writer never leaves a stale lock
behind (the file stays, emptied of meaning). Standard library only: training imports it too.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path


class HolderLock:
    """Context manager: an exclusive ``flock`` on ``path`` whose file names the holder (pid, host, command,
    start time). ``wait_s`` = 0 refuses at once when another process (or another open of it in this
    process) holds it; a positive value waits that long, polling. Raises ``busy(message)``."""

    busy: type[Exception] = RuntimeError

    def __init__(self, path: str | Path, *, wait_s: float = 0.0, poll_s: float = 0.2):
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not wait_s >= 0:
            raise ValueError(f"wait_s must be a number of seconds >= 0, got {wait_s!r}")
        self.path = Path(path)
        self.wait_s, self.poll_s = float(wait_s), poll_s
        self._fd: int | None = None

    def refusal(self, holder: str, waited: str) -> str:
        return f"{self.path} is held{waited} by {holder}"

    def __enter__(self):
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
                    raise self.busy(self.refusal(holder, f" (waited {self.wait_s:.0f} s)" if self.wait_s else "")) \
                        from None
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


@contextlib.contextmanager
def folder_lock(folder: str | Path, *, timeout_s: float, busy_message: str,
                busy: type[Exception] = TimeoutError) -> Iterator[None]:
    """Exclusive ``flock`` on the folder itself (no lock file to leave behind or commit); waits up to ``timeout_s``,
    then raises ``busy(busy_message)``. For short read-modify-write sections of one file in ``folder``."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise busy(busy_message) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the lock
