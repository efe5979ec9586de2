"""`InferenceEndpoint`: one service and a replica set of it answer the same calls (the API, the
Master and rollout loops use either), with the same signatures, and share one `predict`."""

from __future__ import annotations

import inspect

import pytest

from joynexus.services.inference.endpoint import InferenceEndpoint, PredictBySubmit
from joynexus.services.inference.replicas import InferenceReplicaSet
from joynexus.services.inference.service import InferenceModelService

ENDPOINT_METHODS = sorted(
    name for name, member in vars(InferenceEndpoint).items() if callable(member) and not name.startswith("_")
)


def test_the_protocol_names_the_shared_interface():
    assert ENDPOINT_METHODS == sorted(
        [
            "cancel",
            "close",
            "flush_usage",
            "heartbeat",
            "latest_version",
            "load_weights",
            "predict",
            "remove_tenant",
            "stats",
            "submit",
            "tenants",
            "versions",
        ]
    )


@pytest.mark.parametrize("implementation", [InferenceModelService, InferenceReplicaSet])
@pytest.mark.parametrize("name", ENDPOINT_METHODS)
def test_both_implementations_have_every_method_with_the_protocols_signature(implementation, name):
    method = getattr(implementation, name, None)
    assert callable(method), f"{implementation.__name__} lacks {name}"
    want = inspect.signature(getattr(InferenceEndpoint, name))
    got = _without_ray_tracing(inspect.signature(method))
    assert list(got.parameters) == list(want.parameters)
    for parameter, expected in zip(got.parameters.values(), want.parameters.values(), strict=True):
        assert (parameter.kind, parameter.default) == (expected.kind, expected.default), (name, parameter.name)


def test_predict_is_written_once():
    assert InferenceModelService.predict is PredictBySubmit.predict
    assert InferenceReplicaSet.predict is PredictBySubmit.predict


def _without_ray_tracing(signature: inspect.Signature) -> inspect.Signature:
    # Once a test in this process has made the class a Ray actor, Ray's tracing hook has added its
    # `_ray_trace_ctx` keyword to the class's methods in place; it is Ray's, not the interface's.
    return signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "_ray_trace_ctx"])
