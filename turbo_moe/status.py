"""How a training run or a sweep point ended: the one status list and the one out-of-memory detector.

Used by `turbo_moe.train` (a run's `RunResult.status`), the sweep runner (a failed point's row) and
the results tables (which statuses a row may hold). Standard library only: importable without jax.
"""

from __future__ import annotations

import errno
import re

# A training run ends with one of these; `error` carries the explanation for all but "ok".
RUN_STATUSES = ("ok", "oom", "nan", "error")
# A sweep point may also be "skipped": not run because a smaller point of the spec's oom_frontier ran
# out of memory. "error" and "skipped" points are retried on re-run; the FINAL ones are not.
STATUSES = (*RUN_STATUSES, "skipped")
FINAL_STATUSES = ("ok", "oom", "nan")

# Allocator wording of XLA (CPU, CUDA), the CUDA runtime and TensorFlow-era messages.
_OOM = re.compile(r"resource_exhausted|out of memory|failed to allocate|oom when allocating|\boom\b",
                  re.IGNORECASE)
# A full disk reaches us as RESOURCE_EXHAUSTED too (tensorstore/absl status codes): that is storage,
# not memory, and must not become "oom" (final in a sweep, and it feeds the OOM frontier).
_STORAGE = re.compile(r"no space left on device|disk quota exceeded|file too large|\benospc\b|\bedquot\b"
                      r"|os_error_code='(?:28|122|27)'", re.IGNORECASE)
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _chain(error: BaseException) -> list[BaseException]:
    """The error and what caused it (explicit `raise ... from` and implicit context), each once."""
    chain, seen = [], set()
    node: BaseException | None = error
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        chain.append(node)
        node = node.__cause__ or node.__context__
    return chain


def is_oom(error: BaseException | str) -> bool:
    """Device or host memory ran out (an allocator error, MemoryError, or its message text); never a full
    disk or a failed checkpoint save. ``error`` is an exception or the text a notebook kernel reported."""
    if isinstance(error, str):
        return bool(_OOM.search(error)) and not _STORAGE.search(error)
    for e in _chain(error):
        if (isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS) or type(e).__name__ == "CheckpointError" \
                or _STORAGE.search(str(e)):
            return False
    return isinstance(error, MemoryError) or bool(_OOM.search(str(error)))


_BYTES = re.compile(r"(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b")
_UNIT = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
         "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def requested_bytes(message: str) -> int | None:
    """The allocation size an OOM message reports (the largest byte figure in it), if any."""
    sizes = [float(v) * _UNIT[u] for v, u in _BYTES.findall(message)]
    return int(max(sizes)) if sizes else None
