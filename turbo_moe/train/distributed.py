"""One training job over several processes: who they are, `jax.distributed` start and stop, each one's data.

    group = detect()        # None: one process; else ProcessGroup from SLURM, Open MPI or plain variables
    initialize(group)       # jax.distributed.initialize, before any other JAX call
    ...                     # run(config) in every process
    shutdown()              # after a successful run: every process leaves the coordinator together

Where a process group comes from, first match wins:
- plain variables: ``TURBO_MOE_COORDINATOR`` (or ``JAX_COORDINATOR_ADDRESS``) = host:port of process 0,
  ``TURBO_MOE_NUM_PROCESSES`` and ``TURBO_MOE_PROCESS_ID`` (or ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``),
  optionally ``TURBO_MOE_LOCAL_DEVICE_IDS`` (or ``JAX_LOCAL_DEVICE_IDS``) = "0,1" (the GPUs of this host
  this process drives; default all it sees). `turbo-moe launch` sets these.
- a SLURM job step of several tasks (``srun``: ``SLURM_STEP_NUM_TASKS``, ``SLURM_PROCID``, ``SLURM_NODEID``);
- Open MPI (``mpirun``: ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``).
For SLURM and Open MPI the coordinator comes from JAX's cluster detection unless one of the coordinator
variables names it (Open MPI 5 needs that: JAX finds the address only from Open MPI 4's ``OMPI_MCA_orte_hnp_uri``).
One process per host drives every GPU it sees; several processes on a host each drive the GPU of their local
rank, unless the launcher already left each process one GPU (a single entry in ``CUDA_VISIBLE_DEVICES``).
Process topology is runtime plumbing, not configuration: the run's provenance records ``process_count``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from typing import Mapping

from turbo_moe.train.step import batch_sharding

COORDINATOR_VARS = ("TURBO_MOE_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
NUM_PROCESSES_VARS = ("TURBO_MOE_NUM_PROCESSES", "JAX_NUM_PROCESSES")
PROCESS_ID_VARS = ("TURBO_MOE_PROCESS_ID", "JAX_PROCESS_ID")
LOCAL_DEVICE_IDS_VARS = ("TURBO_MOE_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS")
CLUSTERS = ("env", "slurm", "openmpi")


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """This process's place in a job of `num_processes` processes.

    coordinator: host:port of process 0's coordination service; None lets JAX's cluster detection find it.
    local_device_ids: this host's GPUs the process drives; None: every GPU it sees.
    """

    cluster: str
    num_processes: int
    process_id: int
    coordinator: str | None = None
    local_device_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.cluster not in CLUSTERS:
            raise ValueError(f"ProcessGroup.cluster must be one of {CLUSTERS}, got {self.cluster!r}")
        if not (isinstance(self.num_processes, int) and self.num_processes >= 1):
            raise ValueError(f"number of processes must be a positive int, got {self.num_processes!r}")
        if not (isinstance(self.process_id, int) and 0 <= self.process_id < self.num_processes):
            raise ValueError(f"process id must be an int in [0, {self.num_processes}), got {self.process_id!r}")
        if self.coordinator is not None and not re.fullmatch(r"\S+:\d+", self.coordinator):
            raise ValueError(f"coordinator must be host:port, got {self.coordinator!r}")


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if environ.get(name, "") != "":
            return name, environ[name]
    return None


def _int_var(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer") from None


def _device_ids(name: str, text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r}: expected device ids such as '0,1'") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ValueError(f"environment variable {name}={text!r}: expected distinct device ids >= 0")
    return ids


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node `node_id` from SLURM's compressed list, e.g. "2(x3),1" (nodes 0-2: 2 tasks, node 3: 1)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"SLURM tasks per node {tasks_per_node!r}: expected entries like '2' or '2(x3)'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ValueError(f"SLURM node id {node_id} is outside the {len(counts)} nodes of {tasks_per_node!r}")
    return counts[node_id]


def _local_gpu(environ: Mapping[str, str], local_rank: int, local_size: int) -> tuple[int, ...] | None:
    """Which GPU a process of a host with `local_size` processes drives (None: all it sees)."""
    if local_size <= 1:
        return None
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) == 1:  # the launcher (srun --gpus-per-task=1, ...) already gave this process its GPU
        return None
    return (local_rank,)


def detect(environ: Mapping[str, str] | None = None) -> ProcessGroup | None:
    """The process group the environment describes, or None for a job of one process."""
    env = os.environ if environ is None else environ
    coordinator = _first(env, COORDINATOR_VARS)
    count, pid = _first(env, NUM_PROCESSES_VARS), _first(env, PROCESS_ID_VARS)
    local_ids = _first(env, LOCAL_DEVICE_IDS_VARS)
    ids = _device_ids(*local_ids) if local_ids else None
    if count or pid:
        missing = [names[0] for names, found in ((COORDINATOR_VARS, coordinator), (NUM_PROCESSES_VARS, count),
                                                  (PROCESS_ID_VARS, pid)) if not found]
        if missing:
            raise ValueError(f"a multi-process run from environment variables needs {', '.join(missing)} as well "
                             f"(set: {', '.join(v[0] for v in (coordinator, count, pid) if v)})")
        group = ProcessGroup("env", _int_var(env, count[0]), _int_var(env, pid[0]), coordinator[1], ids)
        return group if group.num_processes > 1 else None
    if env.get("SLURM_STEP_NUM_TASKS") and env.get("SLURM_PROCID"):  # inside an srun step, not the batch script
        n = _int_var(env, "SLURM_STEP_NUM_TASKS")
        if n <= 1:
            return None
        local = slurm_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", str(n)),
                                    _int_var(env, "SLURM_NODEID") if env.get("SLURM_NODEID") else 0)
        local_rank = _int_var(env, "SLURM_LOCALID") if env.get("SLURM_LOCALID") else 0
        return ProcessGroup("slurm", n, _int_var(env, "SLURM_PROCID"), coordinator[1] if coordinator else None,
                            ids if ids is not None else _local_gpu(env, local_rank, local))
    if env.get("OMPI_COMM_WORLD_SIZE") and env.get("OMPI_COMM_WORLD_RANK"):
        n = _int_var(env, "OMPI_COMM_WORLD_SIZE")
        if n <= 1:
            return None
        if coordinator is None and not env.get("OMPI_MCA_orte_hnp_uri"):
            raise ValueError("Open MPI without OMPI_MCA_orte_hnp_uri (Open MPI 5): set TURBO_MOE_COORDINATOR="
                             "host:port (a free port on the host of rank 0) for every process")
        local = _int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if env.get("OMPI_COMM_WORLD_LOCAL_SIZE") else n
        local_rank = _int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK") if env.get("OMPI_COMM_WORLD_LOCAL_RANK") else 0
        return ProcessGroup("openmpi", n, _int_var(env, "OMPI_COMM_WORLD_RANK"),
                            coordinator[1] if coordinator else None, ids if ids is not None else _local_gpu(env, local_rank, local))
    if coordinator is not None and coordinator[0] == COORDINATOR_VARS[0]:
        raise ValueError(f"{COORDINATOR_VARS[0]} is set but neither {NUM_PROCESSES_VARS[0]} / {PROCESS_ID_VARS[0]} "
                         f"nor a SLURM or Open MPI job says how many processes there are and which one this is")
    return None


def initialize(group: ProcessGroup | None) -> bool:
    """`jax.distributed.initialize` for `group` (before any other JAX call); False, doing nothing, for None."""
    if group is None:
        return False
    import jax

    detection = {"slurm": "slurm", "openmpi": "ompi"}.get(group.cluster) if group.coordinator is None else None
    port = int(group.coordinator.rsplit(":", 1)[1]) if group.coordinator else None
    if group.process_id == 0 and port is not None:  # process 0 serves the coordinator on its host
        taken = port_taken(port)
        if taken:
            raise ValueError(_port_message(port, taken))
    try:
        # local_device_ids=[]: every device the process sees (None would let the cluster detection pick one GPU).
        jax.distributed.initialize(coordinator_address=group.coordinator, num_processes=group.num_processes,
                                   process_id=group.process_id, local_device_ids=list(group.local_device_ids or []),
                                   cluster_detection_method=detection)
    except Exception as exc:  # taken between the check and the bind: the same one line
        text = str(exc).lower()
        if port is not None and ("address already in use" in text or "failed to bind" in text):
            raise ValueError(_port_message(port, "Address already in use")) from None
        raise
    return True


def port_taken(port: int) -> str | None:
    """Why `port` cannot be listened on at this host (e.g. 'Address already in use'), or None when it can."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the coordinator's server binds
        try:
            sock.bind(("", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _port_message(port: int, why: str) -> str:
    return (f"the coordinator port {port} is taken on this host ({why}); choose another: "
            f"{COORDINATOR_VARS[0]}=<host>:<free port> for every process (turbo-moe launch: --port N, or no --port "
            "for a free one)")


def shutdown() -> None:
    """Leave the coordination service together: a process that exits without it leaves the others' clients
    calling a service that is gone ("Connection refused" at exit)."""
    import jax

    jax.distributed.shutdown()


def batch_share(mesh, global_batch: int) -> tuple[int, int]:
    """(index, count): this process feeds rows [index * B / count, (index + 1) * B / count) of the global batch,
    as the batch sharding over `mesh` places them on its devices (`device_batch` builds the global array from
    that contiguous block). Equals (process_index, process_count) when the mesh lists devices process by process.
    """
    import jax

    blocks = sorted({(index[0].start or 0, global_batch if index[0].stop is None else index[0].stop)
                     for index in batch_sharding(mesh).addressable_devices_indices_map((global_batch, 1)).values()})
    lo, hi = blocks[0][0], blocks[-1][1]
    share = global_batch // jax.process_count()
    gapless = all(stop == start for (_, stop), (start, _) in zip(blocks, blocks[1:]))
    if not gapless or hi - lo != share or lo % share:
        raise ValueError(f"the devices of process {jax.process_index()} hold rows {blocks} of a global batch of "
                         f"{global_batch}: expected one contiguous block of {share} rows (list the mesh's devices "
                         f"process by process)")
    return lo // share, global_batch // share
