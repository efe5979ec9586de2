"""Ray resources per role from configuration (issue 12): parsing, errors that name the role, the
field and the value, and the `.options()` keywords each role's actor is created with."""

from __future__ import annotations

import pytest

from joynexus.actors import configure_placement, role_resources
from joynexus.settings import RoleResources, Settings, parse_role_resources


def test_embedded_defaults_ask_for_nothing_new(monkeypatch):
    for name in ("JOYNEXUS_RESOURCES_JSON", "JOYNEXUS_INFERENCE_SCALING_JSON", "JOYNEXUS_ENVIRONMENT_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings()
    assert settings.resources == {} and settings.environment_workers == 1
    assert (settings.inference_scaling.min_replicas, settings.inference_scaling.max_replicas) == (1, 1)
    assert RoleResources().ray_options(default_num_cpus=1) == {"num_cpus": 1}


def test_resources_from_the_environment_reach_the_actor_options(monkeypatch):
    monkeypatch.setenv(
        "JOYNEXUS_RESOURCES_JSON",
        '{"training_service": {"num_gpus": 0.5, "memory": 1073741824}, '
        '"inference_service": {"num_cpus": 2, "num_gpus": 0.25, "resources": {"joynexus_worker": 0.1}}}',
    )
    monkeypatch.setenv("JOYNEXUS_INFERENCE_SCALING_JSON", '{"min_replicas": 1, "max_replicas": 3}')
    settings = Settings()
    assert settings.inference_scaling.max_replicas == 3 and settings.inference_scaling.elastic
    configure_placement(settings.resources)
    try:
        assert role_resources("training_service").ray_options(default_num_cpus=1) == {
            "num_cpus": 1, "num_gpus": 0.5, "memory": 1073741824,
        }  # fmt: skip
        assert role_resources("inference_service").ray_options(default_num_cpus=1) == {
            "num_cpus": 2, "num_gpus": 0.25, "resources": {"joynexus_worker": 0.1},
        }  # fmt: skip
        assert role_resources("master") == RoleResources()  # not configured: its defaults
    finally:
        configure_placement({})
    assert Settings(resources={"master": {"num_cpus": 0.5}}).resources["master"].num_cpus == 0.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"inference_service": {"num_gpus": 1.5}}', r"role 'inference_service', field num_gpus: .*fractional .*1\.5"),
        ('{"master": {"num_cpus": -1}}', r"role 'master', field num_cpus: .*greater than or equal to 0.*-1"),
        ('{"master": {"gpus": 1}}', r"role 'master', field gpus: Extra inputs are not permitted"),
        ('{"master": {"resources": {"GPU": 1}}}', r"role 'master', field resources: .*'GPU' is not a custom"),
        ('{"master": {"resources": {"x": 0}}}', r"role 'master', field resources: .*x: 0\.0 must be > 0"),
        ('{"trainer": {}}', r"unknown role 'trainer'; roles are master, "),
        ("[1]", r"expected an object"),
        ("{oops", r"not valid JSON"),
    ],
)
def test_bad_resources_name_the_role_field_and_value(text, message):
    with pytest.raises(ValueError, match=f"JOYNEXUS_RESOURCES_JSON: {message}"):
        parse_role_resources(text)


def test_bad_scaling_and_worker_settings_are_refused(monkeypatch):
    monkeypatch.setenv("JOYNEXUS_INFERENCE_SCALING_JSON", '{"min_replicas": 3, "max_replicas": 2}')
    with pytest.raises(
        ValueError, match=r"JOYNEXUS_INFERENCE_SCALING_JSON: .*min_replicas \(3\) must be <= max_replicas"
    ):
        Settings()
    monkeypatch.delenv("JOYNEXUS_INFERENCE_SCALING_JSON")
    with pytest.raises(ValueError, match="environment_workers"):
        Settings(environment_workers=0)
