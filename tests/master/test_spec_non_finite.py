"""Issue 26 (10h): a spec's float fields refuse Infinity and NaN however they are written (JSON's
`Infinity`, YAML's `.inf`, a float), naming the field; bounds such as `ge=0` alone let +inf in."""

from __future__ import annotations

import math

import pytest
import yaml

from joynexus.spec import SpecError, parse_workload_spec
from tests.master.test_spec_checks import rl_spec


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rl": {"value_coef": math.inf}}, "rl.value_coef"),
        ({"rl": {"entropy_coef": "Infinity"}}, "rl.entropy_coef"),
        ({"rl": {"gamma": math.nan}}, "rl.gamma"),
        ({"promotion": {"min_improvement": "NaN"}}, "promotion.min_improvement"),
        ({"adapter": {"alpha": "-Infinity"}}, "adapter.alpha"),
    ],
)
def test_non_finite_floats_are_refused_naming_the_field(change, field):
    with pytest.raises(SpecError) as raised:
        parse_workload_spec(rl_spec(**change))
    assert field in raised.value.fields, raised.value.problems
    reason = dict(raised.value.problems)[field]
    assert "finite" in reason, reason


def test_yaml_infinity_in_a_spec_file_is_refused(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(rl_spec()) + "")
    spec = yaml.safe_load(path.read_text())
    spec["rl"] = {"value_coef": ".inf"}
    path.write_text(yaml.safe_dump(spec).replace("'.inf'", ".inf"))
    assert yaml.safe_load(path.read_text())["rl"]["value_coef"] == math.inf
    with pytest.raises(SpecError) as raised:
        parse_workload_spec(path)
    assert raised.value.fields == ["rl.value_coef"]


def test_finite_values_still_parse():
    spec = parse_workload_spec(rl_spec(rl={"value_coef": 1e6, "entropy_coef": 0.0}))
    assert spec.rl.value_coef == 1e6
