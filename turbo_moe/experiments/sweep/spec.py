"""Sweep specs: load a YAML file, validate it, expand its grid into named points.

A spec names one notebook and the parameter points to run it with::

    name: paths_x_batch                 # optional, defaults to the file stem
    description: TGS/memory/OOM frontier
    notebook: notebooks/02_train.ipynb  # relative to the spec file, the repository root or the cwd
    kernel: turbo-moe                   # optional Jupyter kernel name
    cell_timeout_s: 1800                # optional per-cell limit
    oom_frontier: per_device_batch      # optional: once a point runs out of memory, do not run the
                                        # points that differ from it only by a larger value of this
                                        # parameter (recorded as status "skipped", with the reason)
    record: true                        # the notebook writes a JSON record at `result_json`
    base: {model: small, steps: 40}     # parameters shared by every point
    grid:                               # cartesian product of these axes
      path:                             # an axis whose values are mappings ("bundles") merges them
        - {moe_path: dense_cf, capacity_factor: 1.0}
        - {moe_path: ragged}
      per_device_batch: [1, 2, 4]
    points:                             # explicit points, appended after the grid
      - {moe_path: turbo, per_device_batch: 8}

Every point is ``base`` updated with its grid values and/or explicit entries. Its name is built from the
parameters that vary (``moe_path-ragged__per_device_batch-4``), so names stay stable when points are
added, which is what resume relies on; a name longer than ``MAX_NAME_CHARS`` is cut and ends in a hash
of the full name (still stable, still unique). Every parameter name must be one the notebook's
``parameters`` cell assigns (papermill would only warn, and the point would run with the default), and
every point's values pass the notebook's own parameter check (``params.check_point_values``) before
anything runs, with the error the run would give.

YAML is read as YAML 1.2 reads numbers (``1e-3`` is a float, not the string PyYAML's YAML 1.1 makes of
it), and a key given twice in one mapping is an error naming both lines (YAML 1.1 keeps the last).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from turbo_moe.experiments.sweep import params

DEFAULT_KERNEL = "turbo-moe"
# Parameters the sweep injects into every point; a spec may not set them itself.
RESERVED_PARAMS = ("result_json", "run_name")
_SPEC_KEYS = ("name", "description", "notebook", "kernel", "cell_timeout_s", "record", "oom_frontier", "base", "grid",
              "points")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SCALAR_TYPES = (str, int, float, bool, type(None))
# File names are <name>.json.<pid>.partial and <name>.ipynb: 200 leaves room under the usual 255 bytes.
MAX_NAME_CHARS = 200
# Bounds that keep a hostile or mistaken spec (a YAML alias bomb, a huge grid) from eating the machine.
MAX_SPEC_BYTES = 1 << 20
MAX_SPEC_NODES = 100_000
MAX_POINTS = 10_000


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """One notebook run: its file-safe ``name``, all parameters, and the parameters that name it."""

    name: str
    params: dict[str, Any]
    varying: dict[str, Any]

    @property
    def key(self) -> str:
        """Short hash of all parameters: a finished row only counts for resume if its key matches."""
        return params_key(self.params)


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """A validated sweep spec (see the module docstring for the YAML layout)."""

    name: str
    notebook: Path
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    points: list[dict[str, Any]]
    kernel: str = DEFAULT_KERNEL
    cell_timeout_s: float | None = None
    record: bool = True
    description: str = ""
    source: Path | None = None
    oom_frontier: str | None = None  # a numeric parameter; see the module docstring

    def expand(self) -> list[SweepPoint]:
        """All points: the grid's cartesian product, then the explicit points, in spec order."""
        combos: list[dict[str, Any]] = []
        if self.grid:
            axes = list(self.grid)
            for values in itertools.product(*(self.grid[a] for a in axes)):
                varying: dict[str, Any] = {}
                for axis, value in zip(axes, values):
                    varying.update(value if isinstance(value, Mapping) else {axis: value})
                combos.append(varying)
        combos.extend(dict(p) for p in self.points)
        if not combos:
            combos = [{}]
        points = [SweepPoint(point_name(v), {**self.base, **v}, v) for v in combos]
        _check_unique_names(points)
        return points


def params_key(params: Mapping[str, Any]) -> str:
    """Stable 12-hex-digit hash of a parameter dict (order-independent)."""
    text = json.dumps(dict(params), sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def point_name(varying: Mapping[str, Any]) -> str:
    """File-safe name from the varying parameters, e.g. ``moe_path-ragged__per_device_batch-4``.

    Names over ``MAX_NAME_CHARS`` keep their start and end in ``__h-<hash of the full name>``.
    """
    if not varying:
        return "default"
    parts = [f"{k}-{_format_value(v)}" for k, v in varying.items()]
    name = re.sub(r"[^A-Za-z0-9._=-]+", "_", "__".join(parts))
    if len(name) > MAX_NAME_CHARS:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[:MAX_NAME_CHARS - 14]}__h-{digest}"
    return name


def _format_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return f"{value:.1f}"
    return str(value)


def _check_unique_names(points: list[SweepPoint]) -> None:
    seen: dict[str, dict[str, Any]] = {}
    for p in points:
        if p.name in seen:
            raise ValueError(
                f"sweep points {seen[p.name]} and {p.varying} both get the name {p.name!r}; "
                "make the grid/points differ in a parameter value"
            )
        seen[p.name] = p.varying


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats and duplicate keys refused."""


# YAML 1.2's float forms that YAML 1.1 lacks: an exponent without a dot (1e-3, 2E5).
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *alias` may be overridden by design
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            seen = first.setdefault(key, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key: the base constructor reports it
            continue
        if seen != key_node.start_mark.line + 1:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (first on line {seen}); keep one", key_node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_SpecLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_spec(path: str | Path, *, repo_root: str | Path | None = None) -> SweepSpec:
    """Read and validate a sweep spec YAML file; raises ValueError naming the offending field."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(path.glob("*.yaml"))
        raise ValueError(f"sweep spec {str(path)!r} is a folder, not a YAML file"
                         + (f"; e.g. {inside[0]}" if inside else ""))
    if not path.is_file():
        raise ValueError(f"sweep spec {str(path)!r} does not exist")
    if path.stat().st_size > MAX_SPEC_BYTES:
        raise ValueError(f"sweep spec {str(path)!r} is {path.stat().st_size} bytes; specs are limited to "
                         f"{MAX_SPEC_BYTES} bytes")
    try:
        raw = yaml.load(path.read_text(), Loader=_SpecLoader)  # noqa: S506 — a SafeLoader
    except yaml.YAMLError as exc:
        raise ValueError(f"sweep spec {str(path)!r} is not valid YAML: {_yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"sweep spec {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return spec_from_dict(raw, source=path, repo_root=repo_root)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what the YAML parser objected to, and where (a ``!!python/...`` tag is refused here)."""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def _check_size(raw: Any, where: str) -> None:
    """Refuse specs whose parsed tree is huge: YAML aliases can make 10 lines expand to billions of nodes."""
    count, stack = 0, [raw]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_SPEC_NODES:
            raise ValueError(f"{where}: the spec expands to more than {MAX_SPEC_NODES} values (YAML aliases "
                             "repeating each other?); write the parameters out or split the sweep")
        if isinstance(node, Mapping):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def spec_from_dict(
    raw: Any, *, source: Path | None = None, repo_root: str | Path | None = None, check_values: bool = True
) -> SweepSpec:
    """Validate a parsed spec mapping (see ``load_spec``); ``check_values`` runs the notebook's own
    parameter check on every point (``params.check_point_values``)."""
    where = f"sweep spec {str(source)!r}" if source else "sweep spec"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a YAML mapping at the top level, got {type(raw).__name__}")
    _check_size(raw, where)
    unknown = sorted(set(raw) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed fields are {list(_SPEC_KEYS)}")
    name = raw.get("name", source.stem if source else None)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{where}: field 'name' must be a file-safe string ([A-Za-z0-9._-]), got {name!r}")
    if "notebook" not in raw:
        raise ValueError(f"{where}: field 'notebook' is required (path of the .ipynb to run)")
    base = _check_params(raw.get("base") or {}, f"{where}: field 'base'")
    grid = _check_grid(raw.get("grid") or {}, where)
    points_raw = raw.get("points") or []
    if not isinstance(points_raw, list):
        raise ValueError(f"{where}: field 'points' must be a list of mappings, got {type(points_raw).__name__}")
    points = [_check_params(p, f"{where}: points[{i}]") for i, p in enumerate(points_raw)]
    timeout = raw.get("cell_timeout_s")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"{where}: field 'cell_timeout_s' must be a positive number, got {timeout!r}")
    kernel = raw.get("kernel", DEFAULT_KERNEL)
    if not isinstance(kernel, str) or not kernel:
        raise ValueError(f"{where}: field 'kernel' must be a non-empty string, got {kernel!r}")
    record = raw.get("record", True)
    if not isinstance(record, bool):
        raise ValueError(f"{where}: field 'record' must be true or false, got {record!r}")
    frontier = raw.get("oom_frontier")
    if frontier is not None:
        _check_frontier(frontier, base, grid, points, where)
    n_points = math.prod(len(v) for v in grid.values()) if grid else 0
    if n_points + len(points) > MAX_POINTS:
        raise ValueError(f"{where}: {n_points + len(points)} points; a spec may have at most {MAX_POINTS}")
    notebook = resolve_notebook(raw["notebook"], source=source, repo_root=repo_root)
    check_notebook_parameters(notebook, base, grid, points, record=record, where=where)
    spec = SweepSpec(
        name=name,
        notebook=notebook,
        base=base,
        grid=grid,
        points=points,
        kernel=kernel,
        cell_timeout_s=float(timeout) if timeout is not None else None,
        record=record,
        description=str(raw.get("description", "")),
        source=source,
        oom_frontier=frontier,
    )
    if check_values:
        params.check_point_values(notebook, spec.expand(), where=where)
    return spec


def notebook_parameters(notebook: Path) -> list[str] | None:
    """Names the notebook's cell tagged ``parameters`` assigns, in order (None: it has no such cell)."""
    try:
        cells = json.loads(Path(notebook).read_text()).get("cells", [])
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"sweep spec field 'notebook': cannot read {str(notebook)!r} as a notebook ({exc})") from None
    for cell in cells:
        if "parameters" not in (cell.get("metadata", {}).get("tags") or []):
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else source
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            raise ValueError(f"the parameters cell of {str(notebook)!r} is not plain Python ({exc.msg}, line "
                             f"{exc.lineno}); the spec's parameter names cannot be checked against it") from None
        names: list[str] = []
        for stmt in tree.body:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] \
                if isinstance(stmt, ast.AnnAssign) else []
            for target in targets:
                for node in ast.walk(target):
                    if isinstance(node, ast.Name) and node.id not in names:
                        names.append(node.id)
        return names
    return None


def check_notebook_parameters(
    notebook: Path, base: dict, grid: dict, points: list[dict], *, record: bool = True, where: str = "sweep spec"
) -> None:
    """Every parameter the spec sets must be one the notebook's parameters cell assigns.

    papermill only warns about unknown names, so a typo (``stpes: 3``) would run with the default.
    """
    used: dict[str, str] = {}  # name -> where it is first set
    for key in base:
        used.setdefault(key, "base")
    for axis, values in grid.items():
        for i, value in enumerate(values):
            for key in (value if isinstance(value, Mapping) else {axis: value}):
                used.setdefault(key, f"grid axis {axis!r}" + (f" value [{i}]" if isinstance(value, Mapping) else ""))
    for i, point in enumerate(points):
        for key in point:
            used.setdefault(key, f"points[{i}]")
    known = notebook_parameters(notebook)
    if known is None:
        if used or record:
            raise ValueError(f"{where}: notebook {str(notebook)!r} has no cell tagged 'parameters', so papermill "
                             "cannot set " + (f"{sorted(used)}" if used else "result_json (record: true)"))
        return
    unknown = [key for key in used if key not in known]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=1)
            hints.append(f"{key!r} (in {used[key]}" + (f"; did you mean {close[0]!r}?)" if close else ")"))
        raise ValueError(f"{where}: unknown parameter(s) {', '.join(hints)}: the parameters cell of "
                         f"{Path(notebook).name} sets {known}")
    if record and "result_json" not in known:
        raise ValueError(f"{where}: record is true but notebook {Path(notebook).name} has no parameter "
                         "'result_json' to write its record to; add it to its parameters cell or set record: false")


def _check_frontier(frontier: Any, base: dict, grid: dict, points: list[dict], where: str) -> None:
    """``oom_frontier`` must name a parameter that varies over numbers (the per-device batch, say)."""
    if not isinstance(frontier, str):
        raise ValueError(f"{where}: field 'oom_frontier' must be a parameter name, got {frontier!r}")
    values = [grid[frontier]] if frontier in grid else []
    values += [[v[frontier] for v in axis if isinstance(v, Mapping) and frontier in v] for axis in grid.values()]
    values += [[p[frontier]] for p in points if frontier in p]
    flat = [v for vs in values for v in vs]
    if not flat:
        raise ValueError(f"{where}: field 'oom_frontier' must name a parameter that the grid or points vary, "
                         f"got {frontier!r}")
    bad = [v for v in flat + ([base[frontier]] if frontier in base else [])
           if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise ValueError(f"{where}: field 'oom_frontier': parameter {frontier!r} must take numbers, got {bad[0]!r}")


def _check_params(params: Any, where: str) -> dict[str, Any]:
    if not isinstance(params, Mapping):
        raise ValueError(f"{where} must be a mapping of parameter name to value, got {type(params).__name__}")
    for key, value in params.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"{where}: parameter name {key!r} is not a valid Python identifier")
        if key in RESERVED_PARAMS:
            raise ValueError(f"{where}: parameter {key!r} is set by the sweep itself; remove it")
        if not isinstance(value, (*_SCALAR_TYPES, list, dict)):
            raise ValueError(f"{where}: parameter {key!r} has unsupported type {type(value).__name__}")
    return dict(params)


def _check_grid(grid: Any, where: str) -> dict[str, list[Any]]:
    if not isinstance(grid, Mapping):
        raise ValueError(f"{where}: field 'grid' must be a mapping of axis name to list of values")
    checked: dict[str, list[Any]] = {}
    for axis, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}: grid axis {axis!r} must be a non-empty list, got {values!r}")
        for i, value in enumerate(values):
            if isinstance(value, Mapping):
                _check_params(value, f"{where}: grid axis {axis!r} value [{i}]")
            else:
                _check_params({axis: value}, f"{where}: grid")
        checked[str(axis)] = list(values)
    return checked


def resolve_notebook(
    notebook: Any, *, source: Path | None = None, repo_root: str | Path | None = None
) -> Path:
    """Find the notebook: absolute, or relative to the spec's folder, the repo root, or the cwd."""
    if not isinstance(notebook, (str, Path)) or not str(notebook).endswith(".ipynb"):
        raise ValueError(f"sweep spec field 'notebook' must be a path to a .ipynb file, got {notebook!r}")
    candidate = Path(notebook).expanduser()
    if candidate.is_absolute():
        bases = [Path("/")]
    else:
        bases = [b for b in (source.parent if source else None, repo_root, _repo_root_of(source), Path.cwd()) if b]
    for base in bases:
        if (Path(base) / candidate).is_file():
            return (Path(base) / candidate).resolve()
    raise ValueError(
        f"sweep spec field 'notebook': {str(notebook)!r} not found (looked in {[str(b) for b in bases]})"
    )


def _repo_root_of(source: Path | None) -> Path | None:
    """The folder that holds ``experiments/`` when the spec lives under it."""
    if source is None:
        return None
    for parent in source.resolve().parents:
        if parent.name == "experiments":
            return parent.parent
    return None
