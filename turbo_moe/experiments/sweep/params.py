"""``02_train``'s parameters checked and turned into a ``TrainConfig`` (``train_config``, which the notebooks call
as ``nb.train_config``), with errors that name the parameter.

``check_train_parameters`` runs first in ``train_config``: ``capacity_factor`` and
``train_overrides`` reach ``TrainConfig``/``ModelConfig`` indirectly, so their errors named a config
field (``TypeError: ... unexpected keyword argument 'stpes'``), not the notebook parameter.
``check_point_values`` runs the notebook's own ``train_config`` call on a sweep's points before any runs.
"""

from __future__ import annotations

import ast
import difflib
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from turbo_moe.data import corpus
from turbo_moe.data.dataset import NAMED_DATASETS
from turbo_moe.train import TrainConfig
from turbo_moe.train.config import FIELD_NAMES, REMOVED_FIELDS
from turbo_moe.train.config_groups import GROUPS
from turbo_moe.validation import ConfigError

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
    if train_overrides is None:
        return {}
    if not isinstance(train_overrides, Mapping):
        raise ValueError(f"parameter train_overrides: must be a dict of TrainConfig fields, got "
                         f"{type(train_overrides).__name__} {train_overrides!r}")
    # the flat names, MaxText's top-level remat_policy (TrainConfig moves it into the model overrides) included
    fields = list(FIELD_NAMES)
    taken = set(OWN_PARAMETERS) | set(explicit)
    for key, value in train_overrides.items():
        if key not in (*fields, *GROUPS, *REMOVED_FIELDS):  # a sub-config's section; a removed field says why
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; TrainConfig fields are {fields}"
            raise ValueError(f"parameter train_overrides: unknown key {key!r}{hint}")
        if key in taken:
            raise ValueError(f"parameter train_overrides: key {key!r} is set by the notebook parameter {key!r}; "
                             "set it there instead")
        try:
            TrainConfig.from_dict({key: value})  # the field's own validation, on its own
        except (TypeError, ValueError) as exc:
            raise ValueError(f"parameter train_overrides: key {key!r}: {exc}") from None
    return dict(train_overrides)


def check_train_parameters(*, capacity_factor: Any = None, train_overrides: Any = None,
                           explicit: Iterable[str] = ()) -> tuple[float | None, dict[str, Any]]:
    """(capacity factor or None, train overrides): both checked, errors naming the notebook parameter."""
    return check_capacity_factor(capacity_factor), check_train_overrides(train_overrides, explicit)


def train_config(
    *,
    model: str,
    moe_path: str,
    per_device_batch: int,
    steps: int,
    capacity_factor: float | None = None,
    model_overrides: Mapping[str, Any] | None = None,
    train_overrides: Mapping[str, Any] | None = None,
    **fields: Any,
):
    """A validated ``TrainConfig`` from notebook parameters; raises ValueError naming the bad parameter.

    ``moe_path`` ("auto": the device's fastest dropless path, as ModelConfig resolves it) and ``capacity_factor``
    (None keeps the preset's) go into the model overrides;
    ``fields`` are TrainConfig fields (dataset, seq_len, seed, ...); ``train_overrides`` adds any other.
    """
    if isinstance(per_device_batch, bool) or not isinstance(per_device_batch, int) or per_device_batch <= 0:
        raise ValueError(f"parameter per_device_batch: must be a positive int, got {per_device_batch!r}")
    if not isinstance(model_overrides or {}, Mapping):
        raise ValueError(f"parameter model_overrides: must be a dict, got {type(model_overrides).__name__}")
    capacity_factor, train_overrides = check_train_parameters(
        capacity_factor=capacity_factor, train_overrides=train_overrides, explicit=fields)
    overrides = {**(model_overrides or {}), "moe_path": moe_path}
    if capacity_factor is not None and not (isinstance(capacity_factor, float) and math.isnan(capacity_factor)):
        overrides["capacity_factor"] = float(capacity_factor)
    try:
        return TrainConfig.from_dict({"model": model, "model_overrides": overrides,
                                      "per_device_batch": per_device_batch, "steps": steps, **fields,
                                      **dict(train_overrides or {})})
    except ConfigError as err:  # ModelConfig's check of moe_path: named as the notebook's parameter
        if err.field != "moe_path":
            raise
        raise ValueError(f"parameter moe_path: unknown path {err.value!r}; expected {err.allowed}") from err


# ---------------------------------------------------------------------------------------- sweep dry runs
# A sweep checks every point's values before anything runs, with the same function and so the same error
# as the notebook: the keyword arguments of the notebook's own ``train_config(...)`` call, filled from its
# parameters cell (defaults) and the point. Paths are checked where the kernel would resolve them (the
# notebook's folder).
CONFIG_CALL = "train_config"


def notebook_defaults(notebook: str | Path) -> dict[str, Any]:
    """The literal values the notebook's ``parameters`` cell assigns (a non-literal value is left out)."""
    defaults: dict[str, Any] = {}
    for cell in _code_cells(notebook):
        if "parameters" not in (cell.get("metadata", {}).get("tags") or []):
            continue
        for stmt in _parse(cell).body:
            if isinstance(stmt, ast.Assign):
                targets, value = stmt.targets, stmt.value
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                targets, value = [stmt.target], stmt.value
            else:
                continue
            try:
                literal = ast.literal_eval(value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    defaults[target.id] = literal
        break
    return defaults


def config_call_arguments(notebook: str | Path) -> dict[str, Any] | None:
    """``{keyword: parameter name}`` of the notebook's ``train_config(...)`` call (None: it makes none, or an
    argument is not a plain name or constant, so its values cannot be checked outside the kernel)."""
    for cell in _code_cells(notebook):
        if "parameters" in (cell.get("metadata", {}).get("tags") or []):
            continue
        for node in ast.walk(_parse(cell)):
            if not (isinstance(node, ast.Call) and _called_name(node.func) == CONFIG_CALL):
                continue
            if node.args or any(k.arg is None for k in node.keywords):
                return None
            arguments: dict[str, Any] = {}
            for keyword in node.keywords:
                if isinstance(keyword.value, ast.Name):
                    arguments[keyword.arg] = _Name(keyword.value.id)
                elif isinstance(keyword.value, ast.Constant):
                    arguments[keyword.arg] = keyword.value.value
                else:
                    return None
            return arguments
    return None


def check_point_values(notebook: str | Path, points: Iterable[Any], *, where: str = "sweep spec") -> None:
    """Raise ValueError ``<where>: point <name>: <the run's own error>`` for the first point whose values the
    notebook would refuse. Notebooks without a ``train_config`` call are not checked here."""
    arguments = config_call_arguments(notebook)
    if arguments is None:
        return
    defaults = notebook_defaults(notebook)
    for point in points:
        values = {**defaults, **point.params}
        if any(isinstance(v, _Name) and v not in values for v in arguments.values()):
            return  # a default that is not a literal: only the kernel knows it
        kwargs = {k: values[v] if isinstance(v, _Name) else v for k, v in arguments.items()}
        try:
            tc = train_config(**kwargs)
            check_paths(tc, Path(notebook).parent)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise ValueError(f"{where}: point {point.name}: {exc}") from None


def check_paths(tc: Any, cwd: Path) -> None:
    """A dataset path must exist and hold corpus files, resolved from ``cwd`` as the kernel would."""
    if tc.dataset in (*NAMED_DATASETS, "synthetic"):
        return
    path = Path(tc.dataset).expanduser()
    corpus.list_corpus_files(path if path.is_absolute() else cwd / path)


class _Name(str):
    """A parameter name (as opposed to a constant string) in a notebook call."""


def _code_cells(notebook: str | Path) -> list[dict]:
    try:
        cells = json.loads(Path(notebook).read_text()).get("cells", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [c for c in cells if isinstance(c, dict) and c.get("cell_type") == "code"]


def _parse(cell: dict) -> ast.Module:
    source = cell.get("source", "")
    source = "".join(source) if isinstance(source, list) else str(source)
    # IPython magics (%matplotlib) are not Python: blank them so the rest parses.
    source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    try:
        return ast.parse(source)
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None
