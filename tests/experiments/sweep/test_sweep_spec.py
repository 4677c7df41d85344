"""Spec validation, grid expansion and point naming (no notebook execution)."""

import pytest

from turbo_moe.experiments.sweep.spec import load_spec, point_name, spec_from_dict


def _spec(toy_notebook, **fields):
    return spec_from_dict({"name": "s", "notebook": str(toy_notebook), **fields})


def test_grid_bundles_and_points_expand_in_order(toy_notebook):
    spec = _spec(
        toy_notebook,
        base={"steps": 3, "model": "small"},
        grid={"path": [{"moe_path": "dense_cf", "capacity_factor": 2.0}, {"moe_path": "ragged"}],
              "per_device_batch": [1, 4]},
        points=[{"moe_path": "turbo", "steps": 5}],
    )
    points = spec.expand()
    assert [p.name for p in points] == [
        "moe_path-dense_cf__capacity_factor-2.0__per_device_batch-1",
        "moe_path-dense_cf__capacity_factor-2.0__per_device_batch-4",
        "moe_path-ragged__per_device_batch-1",
        "moe_path-ragged__per_device_batch-4",
        "moe_path-turbo__steps-5",
    ]
    assert points[0].params == {"steps": 3, "model": "small", "moe_path": "dense_cf",
                                "capacity_factor": 2.0, "per_device_batch": 1}
    assert points[-1].params["steps"] == 5  # explicit point overrides base
    assert len({p.key for p in points}) == len(points)


def test_no_grid_gives_one_default_point(toy_notebook):
    (point,) = _spec(toy_notebook, base={"x": 2}).expand()
    assert point.name == "default" and point.params == {"x": 2}


def test_key_changes_with_base_parameters(toy_notebook):
    a = _spec(toy_notebook, base={"steps": 3}, grid={"x": [1]}).expand()[0]
    b = _spec(toy_notebook, base={"steps": 4}, grid={"x": [1]}).expand()[0]
    assert a.name == b.name and a.key != b.key


def test_point_name_is_file_safe():
    assert point_name({"dataset": "/data/my text.txt"}) == "dataset-_data_my_text.txt"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"grid": {"x": []}}, "grid axis 'x' must be a non-empty list"),
        ({"grid": {"x": 3}}, "grid axis 'x' must be a non-empty list"),
        ({"base": {"result_json": "a.json"}}, "'result_json' is set by the sweep"),
        ({"points": [{"1x": 2}]}, "not a valid Python identifier"),
        ({"colour": "red"}, "unknown field(s) ['colour']"),
        ({"name": "has space"}, "field 'name' must be a file-safe string"),
        ({"cell_timeout_s": -1}, "'cell_timeout_s' must be a positive number"),
        ({"points": [{"x": 1}, {"x": 1}]}, "both get the name 'x-1'"),
    ],
)
def test_bad_specs_name_the_field(toy_notebook, fields, message):
    with pytest.raises(ValueError) as err:
        _spec(toy_notebook, **fields).expand()
    assert message in str(err.value)


def test_missing_notebook_is_a_clear_error(tmp_path):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("notebook: nowhere.ipynb\n")
    with pytest.raises(ValueError, match="'nowhere.ipynb' not found"):
        load_spec(spec_file)


def test_notebook_resolved_relative_to_repo_root(tmp_path, toy_notebook):
    sweeps = tmp_path / "experiments" / "sweeps"
    sweeps.mkdir(parents=True)
    (sweeps / "mine.yaml").write_text("notebook: toy.ipynb\ngrid: {x: [1, 2]}\n")
    spec = load_spec(sweeps / "mine.yaml")
    assert spec.name == "mine" and spec.notebook == toy_notebook.resolve()
