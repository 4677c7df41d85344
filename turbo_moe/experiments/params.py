"""Checks of ``02_train``'s parameters whose errors would otherwise not name the parameter.

``check_train_parameters`` is meant to run first in ``notebook.train_config``: ``capacity_factor`` and
``train_overrides`` reach ``TrainConfig``/``ModelConfig`` indirectly, so their errors named a config
field (``TypeError: ... unexpected keyword argument 'stpes'``), not the notebook parameter.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

# Set by their own notebook parameters (or by the sweep): a train_overrides entry may not set them too.
OWN_PARAMETERS = ("model", "model_overrides", "moe_path", "capacity_factor", "per_device_batch", "steps")


def check_capacity_factor(capacity_factor: Any) -> float | None:
    """The capacity factor as a float, or None (None or NaN keep the preset's); ValueError naming it."""
    if capacity_factor is None or (isinstance(capacity_factor, float) and math.isnan(capacity_factor)):
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
        raise ValueError(f"parameter capacity_factor: must be a positive number or None, got "
                         f"{type(capacity_factor).__name__} {capacity_factor!r}")
    if not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"parameter capacity_factor: must be a positive finite number or None, got {capacity_factor!r}")
    return float(capacity_factor)


def check_train_overrides(train_overrides: Any, explicit: Iterable[str] = ()) -> dict[str, Any]:
    """``train_overrides`` as a dict of TrainConfig fields; ValueError naming the parameter and the key.

    ``explicit``: the TrainConfig fields the notebook passes from its own parameters (seq_len, seed, ...).
    Each value is checked by TrainConfig's own validation, so a bad value is reported here too.
    """
    from turbo_moe.train import TrainConfig

    if train_overrides is None:
        return {}
    if not isinstance(train_overrides, Mapping):
        raise ValueError(f"parameter train_overrides: must be a dict of TrainConfig fields, got "
                         f"{type(train_overrides).__name__} {train_overrides!r}")
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    taken = set(OWN_PARAMETERS) | set(explicit)
    for key, value in train_overrides.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; TrainConfig fields are {fields}"
            raise ValueError(f"parameter train_overrides: unknown key {key!r}{hint}")
        if key in taken:
            raise ValueError(f"parameter train_overrides: key {key!r} is set by the notebook parameter {key!r}; "
                             "set it there instead")
        try:
            TrainConfig(**{key: value})  # the field's own validation, on its own
        except (TypeError, ValueError) as exc:
            raise ValueError(f"parameter train_overrides: key {key!r}: {exc}") from None
    return dict(train_overrides)


def check_train_parameters(*, capacity_factor: Any = None, train_overrides: Any = None,
                           explicit: Iterable[str] = ()) -> tuple[float | None, dict[str, Any]]:
    """(capacity factor or None, train overrides): both checked, errors naming the notebook parameter."""
    return check_capacity_factor(capacity_factor), check_train_overrides(train_overrides, explicit)
