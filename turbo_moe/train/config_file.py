"""A TrainConfig file: YAML (or JSON) with `--set key=value` overrides, as `turbo-moe train` and `launch` read it.

    load_train_config("experiments/configs/tiny.yaml", ["steps=20", "model_overrides.moe_path=ragged"])

A config file is a mapping of `TrainConfig` fields, flat or in a section per sub-config (`optimizer:`, `data:`,
`parallel:`, `checkpoint:`), model overrides nested under `model_overrides` (or a whole ModelConfig mapping under
`model`), as `TrainConfig.from_dict` reads them. `--set key=value` replaces one value after the file is read: `key`
is a field, or a dotted path into a nested mapping (`model_overrides.moe_path=turbo`, `optimizer.learning_rate=1e-3`);
`value` is read as YAML (`20`, `3e-3`, `true`, `null`, `ragged`). The config checks every value and names the field
it refuses; a file that cannot be read, is not UTF-8 or not YAML is named with the reason.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import yaml

from turbo_moe.train.config import TrainConfig


class _Loader(yaml.SafeLoader):
    """YAML 1.1's SafeLoader, except that `3e-3` and `1e5` are floats (YAML 1.2), not strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"{where}: not valid YAML{at}: {problem}") from None


def parse_set(item: str) -> tuple[list[str], Any]:
    """'model_overrides.moe_path=turbo' -> (['model_overrides', 'moe_path'], 'turbo')."""
    key, sep, text = item.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in keys):
        raise ValueError(f"--set {item!r}: expected key=value with key a field name or a dotted path such as "
                         f"model_overrides.moe_path")
    return keys, _yaml(text, f"--set {item!r}") if text.strip() else None


def apply_sets(values: dict[str, Any], sets: Sequence[str]) -> dict[str, Any]:
    """`values` with each `--set key=value` applied in order (nested mappings copied, never changed in place)."""
    out = dict(values)
    for item in sets:
        keys, value = parse_set(item)
        node = out
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ValueError(f"--set {item!r}: {'.'.join(keys[:depth + 1])} is {child!r}, not a mapping")
            node[key] = child = dict(child)
            node = child
        node[keys[-1]] = value
    return out


def load_train_config(path: str | Path, sets: Sequence[str] = ()) -> TrainConfig:
    """The TrainConfig of a YAML/JSON file with `--set` overrides; ValueError naming the file, key or field."""
    return config_from_values(load_config_values(path, sets), path)


def load_config_values(path: str | Path, sets: Sequence[str] = ()) -> dict[str, Any]:
    """The mapping a config file holds, with `--set` overrides applied (not yet a TrainConfig: the run folder may add
    its checkpoint_dir); ValueError naming the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"config file {str(path)!r}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {str(path)!r}: not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}); "
                         "expected a YAML file of TrainConfig fields") from None
    values = _yaml(text, f"config file {str(path)!r}")
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ValueError(f"config file {str(path)!r}: expected a mapping of TrainConfig fields, got "
                         f"{type(values).__name__}")
    return apply_sets(values, sets)


def config_from_values(values: dict[str, Any], path: str | Path) -> TrainConfig:
    try:
        return TrainConfig.from_dict(values)
    except TypeError as exc:  # e.g. model_overrides given as a list
        raise ValueError(f"config {str(path)!r}: {exc}") from None
