"""A schema-driven fuzz run over the OpenAPI document: whatever schemathesis generates (valid or
not), no endpoint answers 5xx, and every error body is the documented JSON shape.

Bounded to a few examples per operation (derandomized, so a run is repeatable) to fit ~1 minute.
The fuzzing tenant has a zero spend cap, so a generated request that happens to be valid is
refused admission (429) instead of starting real work."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

MAX_EXAMPLES = 10  # per operation and generation mode (valid / invalid inputs)


@pytest.fixture(scope="session")
def fuzz_tenant(api):
    tenant = api.tenant("fuzz")
    capped = api.client.put(
        f"/v1/admin/tenants/{tenant.tenant_id}/quota", json={"max_device_seconds": 0.0}, headers=api.admin
    )
    assert capped.status_code == 200
    return tenant


def test_the_openapi_document_describes_both_layers(api):
    document = api.client.get("/openapi.json").json()
    paths = document["paths"]
    for path in ("/v1/train_batch", "/v1/forward_backward", "/v1/optim_step", "/v1/predict", "/v1/workloads",
                 "/v1/workloads/{workload_id}/stream", "/v1/versions/{version}/export", "/v1/env/sessions",
                 "/v1/queue/partitions/{partition}", "/v1/weights/load", "/v1/save", "/v1/usage"):  # fmt: skip
        assert path in paths, path
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    tensor = document["components"]["schemas"]["Tensor"]
    assert set(tensor["properties"]["dtype"]["enum"]) == {
        "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"
    }  # fmt: skip


def test_no_generated_request_makes_the_server_fail(api, fuzz_tenant):
    from hypothesis import given
    from schemathesis import GenerationMode

    openapi = schemathesis.openapi.from_asgi("/openapi.json", api.app)
    operations = [result.ok() for result in openapi.get_all_operations()]
    assert len(operations) > 30
    failures: list[str] = []

    def check(case) -> None:
        headers = api.admin if case.path.startswith("/v1/admin") else fuzz_tenant.headers
        response = case.call(headers=headers)
        where = f"{case.method} {case.formatted_path}"
        if response.status_code >= 500:
            failures.append(f"{where}: {response.status_code} {response.text[:300]}")
        elif response.status_code >= 400:
            body = response.json()
            if not {"code", "message", "problems"} <= set(body) or "Traceback" in response.text:
                failures.append(f"{where}: undocumented error body {response.text[:300]}")

    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=MAX_EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def run(case) -> None:
                check(case)

            try:
                run()
            except Exception as error:  # a strategy that cannot generate (e.g. no negative form)
                if "Unsatisfiable" not in type(error).__name__:
                    raise
    assert not failures, "\n".join(failures[:20])
