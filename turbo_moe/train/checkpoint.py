"""Orbax checkpoints of the TrainState plus a JSON record (step, history, config) for exact resume.

The state is saved as a flat {name: array} dict keyed by each leaf's pytree path, so a checkpoint
does not depend on how nnx/optax lay out their containers, and restore checks every leaf's name and
shape against a freshly initialised state of the same config.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def _leaf_names(tree) -> list[str]:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    names = [re.sub(r"[^A-Za-z0-9_]+", ".", p).strip(".") for p in paths]  # file-system friendly
    if len(set(names)) != len(names):
        raise ValueError("checkpoint leaf names collide after sanitising; cannot save this state")
    return names


def flatten_state(state) -> dict[str, Any]:
    return dict(zip(_leaf_names(state), jax.tree.leaves(state)))


def unflatten_state(flat: dict[str, Any], like):
    names = _leaf_names(like)
    missing = sorted(set(names) - set(flat))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} state entries, e.g. {missing[:3]}; was it "
                         f"written for a different model config?")
    return jax.tree.unflatten(jax.tree.structure(like), [flat[n] for n in names])


class Checkpointer:
    """Save/restore (TrainState, record) under `directory/<step>/` with orbax, keeping the last `keep`."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory).expanduser().resolve()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "record"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, record: dict) -> None:
        """Asynchronous save; `wait()` (or the next save) makes it durable."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(flatten_state(state)), record=ocp.args.JsonSave(record)))

    def restore(self, like, step: int | None = None) -> tuple[Any, dict]:
        """(state with `like`'s structure and shardings, record) at `step` (default: latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        target = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                  for name, x in flatten_state(like).items()}
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), record=ocp.args.JsonRestore()))
        return unflatten_state(restored["state"], like), restored["record"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
