"""One writer at a time: an ``flock`` on a lock file that names its holder (``HolderLock``).

One sweep at a time per results table (``SweepLock``, on ``results/.<sweep>.csv.lock``); the
checkpoints use the same lock for one writer per checkpoint folder (``turbo_moe.train.checkpoint``).

Two sweeps writing the same table would each run the same points, replace each other's records and
mark each other's finished points as errors. The lock file names its holder (pid, host, command, start
time) so the refusal can say who is running; the kernel drops the lock when that process dies, so a
killed sweep never leaves a stale lock behind (the file itself stays, empty of meaning).
"""

from __future__ import annotations

from pathlib import Path

from turbo_moe.writer_lock import HolderLock


class SweepBusy(RuntimeError):
    """Another process holds the sweep lock of this results table."""


def lock_path(table: Path) -> Path:
    return table.with_name(f".{table.name}.lock")


class SweepLock(HolderLock):
    """The lock of one results ``table``, held for the life of a sweep (raises ``SweepBusy``)."""

    busy = SweepBusy

    def __init__(self, table: str | Path, *, wait_s: float = 0.0, poll_s: float = 0.2):
        self.table = Path(table)
        super().__init__(lock_path(self.table), wait_s=wait_s, poll_s=poll_s)

    def refusal(self, holder: str, waited: str) -> str:
        return (f"another sweep is writing {self.table}{waited}: {holder}. Wait for it to finish "
                f"(or pass --wait SECONDS), or give this sweep another --experiments-dir")
