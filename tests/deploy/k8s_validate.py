"""Validate rendered manifests (YAML on stdin) against the Kubernetes OpenAPI schemas of
kubernetes-validate (strict: unknown fields are errors) and the vendored KubeRay RayCluster and
External Secrets Operator (v2.9.0: ExternalSecret, SecretStore) schemas (schemas/); the Kubernetes
types nested in a RayCluster (marked x-k8s-type there) are validated against the Kubernetes schemas
too. Prints a JSON list of errors. Run by tests/deploy/test_schemas.py with whichever interpreter has
kubernetes_validate (the project's or .venv-tools')."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRDS = {
    ("ray.io/v1", "RayCluster"): "raycluster-ray-v1.json",
    ("external-secrets.io/v1", "ExternalSecret"): "externalsecret-external-secrets-v1.json",
    ("external-secrets.io/v1", "SecretStore"): "secretstore-external-secrets-v1.json",
}


def _k8s_definition_validator(version: str, type_name: str) -> jsonschema.Validator:
    defs = schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    uri = defs.get("$id", "https://kubernetes.io/api/_definitions.json")
    key = "$defs" if "$defs" in defs else "definitions"
    schema = {"$ref": f"{uri}#/{key}/{type_name}"}
    registry = Registry().with_resource(uri, Resource.from_contents(defs))
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _nested(schema: dict, value, where: str):
    """(x-k8s-type, value, path) for every Kubernetes-typed value inside a CRD instance."""
    if not isinstance(schema, dict):
        return
    if "x-k8s-type" in schema:
        yield schema["x-k8s-type"], value, where
        return
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                yield from _nested(sub, value[key], f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from _nested(schema["items"], item, f"{where}[{i}]")


def validate(docs: list[dict], version: str) -> list[str]:
    full = next(v for v in kubernetes_validate.utils.all_versions() if v.startswith(version))
    errors = []
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        crd = CRDS.get((doc.get("apiVersion"), doc.get("kind")))
        if crd:
            schema = json.loads((SCHEMAS / crd).read_text())
            for error in jsonschema.Draft202012Validator(schema).iter_errors(doc):
                errors.append(f"{name}: {'.'.join(map(str, error.absolute_path))}: {error.message}")
            for type_name, value, where in _nested(schema, doc, ""):
                for error in _k8s_definition_validator(full, type_name).iter_errors(value):
                    path = ".".join(map(str, error.absolute_path))
                    errors.append(f"{name}: {where}.{path}: {error.message}")
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{name}: {'.'.join(map(str, error.path))}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"{name}: no schema: {error}")
    return errors


if __name__ == "__main__":
    documents = [d for d in yaml.safe_load_all(sys.stdin.read()) if d]
    print(json.dumps(validate(documents, sys.argv[1] if len(sys.argv) > 1 else "1.35")))
