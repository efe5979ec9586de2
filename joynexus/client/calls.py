"""What each API operation sends (`Calls`, one `Call` each, checked before sending), and the
request bodies built from numpy / torch / lists and spec files; shared by both clients."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from joynexus.client.errors import InvalidArgument, SpecFileError
from joynexus.client.transport import Call
from joynexus.protocol import schemas as s
from joynexus.protocol import state_control as sc
from joynexus.protocol.spec_yaml import load_spec_yaml
from joynexus.protocol.wire import (
    Tensor,
    TensorKind,
    WireError,
    as_tensor,
)

VERSIONS_PAGE = 1000  # checkpoints per GET /v1/versions page when the client pages through all
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")


def dataset_archive(path: str | Path) -> tuple[bytes, str]:
    """What `upload_dataset` sends: a LeRobot dataset folder packed as tar.gz (in memory), or an
    archive file (.tar, .tar.gz, .tgz, .zip) as it is; and the folder's (or archive's) bare name."""
    import io
    import tarfile

    path = Path(path)
    if path.is_dir():
        if not (path / "meta" / "info.json").is_file():
            raise InvalidArgument([("path", f"{str(path)!r} is not a LeRobot dataset folder (no meta/info.json)")])
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            tar.add(path, arcname=path.name)
        return buffer.getvalue(), path.name
    name = path.name.lower()
    suffix = next((s for s in ARCHIVE_SUFFIXES if name.endswith(s)), None)
    if not path.is_file() or suffix is None:
        reason = f"{str(path)!r} is neither a dataset folder nor a {', '.join(ARCHIVE_SUFFIXES)} archive"
        raise InvalidArgument([("path", reason)])
    try:
        return path.read_bytes(), path.name[: -len(suffix)]
    except OSError as error:
        raise InvalidArgument([("path", f"cannot read {str(path)!r}: {error.strerror or error}")]) from None


def default_repo_id(name: str) -> str:
    """`local/<name>` with the characters a repo id refuses replaced (the server checks the pattern)."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in name).lstrip("._-") or "dataset"
    return f"local/{cleaned[:96]}"


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """A workload spec file (YAML, or JSON for a `.json` file) as a dict. SpecFileError names the
    file, and for a syntax error its line and column, with the parser's reason."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SpecFileError(path, f"cannot be read ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise SpecFileError(path, f"is not UTF-8 text (byte {error.start})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise SpecFileError(path, f"JSON syntax error: {error.msg}", error.lineno, error.colno) from None
    else:
        try:
            data = load_spec_yaml(text)
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            reason = ": ".join(part for part in (error.context, error.problem) if part) or "not valid YAML"
            line, column = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
            raise SpecFileError(path, f"YAML syntax error: {reason}", line, column) from None
        except yaml.YAMLError as error:
            raise SpecFileError(path, f"YAML syntax error: {error}") from None
    if not isinstance(data, dict):
        got = "nothing" if data is None else f"a {type(data).__name__}"
        raise SpecFileError(path, f"holds {got}, not a mapping of spec fields (tenant, task, observation, ...)")
    return data


def _spec_dict(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    if isinstance(spec, str | Path):
        return load_spec_file(spec)
    if isinstance(spec, BaseModel):
        return spec.model_dump(mode="json")
    try:
        return dict(spec)
    except (TypeError, ValueError):
        reason = f"expected a dict, a WorkloadSpec or a file path, got {type(spec).__name__}"
        raise InvalidArgument([("spec", reason)]) from None


def _tensor(value: Any, field: str, kind: TensorKind = "float") -> Tensor | None:
    """A request tensor (see `wire.as_tensor`: plain lists get the dtype `kind` names)."""
    if value is None:
        return None
    try:
        return as_tensor(value, field, kind)
    except WireError as error:
        raise InvalidArgument([(error.field, error.reason)]) from None


def _samples(images: Any, state: Any, action: Any, action_is_pad: Any, instructions: list[str] | None) -> dict:
    return {
        "images": _tensor(images, "images", "image"),
        "state": _tensor(state, "state"),
        "action": _tensor(action, "action"),
        "action_is_pad": _tensor(action_is_pad, "action_is_pad", "bool"),
        "instructions": instructions,
    }


def _columns(columns: dict[str, Any]) -> dict[str, Any]:
    """Queue columns: lists of strings as they are; arrays / tensors as tensors with their dtype
    (numbers in a plain list are refused: a queue column's dtype is not known here)."""
    out: dict[str, Any] = {}
    for key, value in columns.items():
        if isinstance(value, list | tuple):
            if not all(isinstance(item, str) for item in value):
                reason = "a list is a column of strings; pass numbers as a numpy array (its dtype is kept)"
                raise InvalidArgument([(f"columns.{key}", reason)])
            out[key] = list(value)
        elif isinstance(value, Tensor):
            out[key] = value
        else:
            try:
                out[key] = Tensor.from_numpy(value.detach().cpu().numpy() if hasattr(value, "detach") else value)
            except (WireError, ValueError, TypeError) as error:
                raise InvalidArgument([(f"columns.{key}", str(getattr(error, "reason", error)))]) from None
    return out


def _checked(builder: Any) -> Any:
    """A request builder whose invalid arguments (pydantic's checks of the request models) raise
    InvalidArgument with their fields, before anything is sent."""

    @functools.wraps(builder)
    def build(*args: Any, **kwargs: Any) -> Call:
        try:
            return builder(*args, **kwargs)
        except ValidationError as error:
            problems = [
                (".".join(str(part) for part in item["loc"]) or "argument", item["msg"]) for item in error.errors()
            ]
            raise InvalidArgument(problems) from None

    return staticmethod(build)


def _check_builders(cls: type) -> type:
    for name, value in list(vars(cls).items()):
        if isinstance(value, staticmethod):
            setattr(cls, name, _checked(value.__func__))
    return cls


@_check_builders
class Calls:
    """What each API operation sends; each returns a `Call`."""

    @staticmethod
    def tenant() -> Call:
        return Call("GET", "/v1/tenant", s.TenantInfo)

    @staticmethod
    def submit(spec: Any, jobs: int | None) -> Call:
        return Call("POST", "/v1/workloads", s.WorkloadInfo, s.WorkloadSubmit(jobs=jobs, spec=_spec_dict(spec)))

    @staticmethod
    def evaluate(
        version: int | None,
        episodes: int,
        environment: dict[str, Any] | None,
        suite: list[dict[str, Any]] | None = None,
        videos: int = 0,
    ) -> Call:
        body = s.WorkloadSubmit(
            task="eval", version=version, episodes=episodes, environment=environment, suite=suite, videos=videos
        )
        return Call("POST", "/v1/workloads", s.WorkloadInfo, body)

    @staticmethod
    def workload(workload_id: str) -> Call:
        return Call("GET", f"/v1/workloads/{workload_id}", s.WorkloadInfo)

    @staticmethod
    def workloads() -> Call:
        return Call("GET", "/v1/workloads", list[s.WorkloadInfo])

    @staticmethod
    def cancel(workload_id: str) -> Call:
        return Call("POST", f"/v1/workloads/{workload_id}/cancel", s.WorkloadInfo)

    @staticmethod
    def events(workload_id: str, after: int) -> Call:
        return Call("GET", f"/v1/workloads/{workload_id}/events", s.WorkloadEvents, params={"after": after})

    @staticmethod
    def versions(after: int | None, limit: int) -> Call:
        params = {"limit": limit} if after is None else {"after": after, "limit": limit}
        return Call("GET", "/v1/versions", s.Versions, params=params)

    @staticmethod
    def versions_page(after: int | None) -> Call:
        """One page of VERSIONS_PAGE checkpoints, as the clients ask when they page through all."""
        return Calls.versions(after, VERSIONS_PAGE)

    @staticmethod
    def export_version(version: int) -> Call:
        return Call("GET", f"/v1/versions/{version}/export", params={"format": "safetensors"}, raw=True)

    @staticmethod
    def delete_version(version: int) -> Call:
        return Call("DELETE", f"/v1/versions/{version}", s.VersionDeleted)

    @staticmethod
    def export_params() -> Call:
        return Call("POST", "/v1/params/export", s.ExportedParams)

    @staticmethod
    def checkpoint_manifest(version: int) -> Call:
        return Call("GET", f"/v1/checkpoints/{version}/manifest", s.Manifest)

    @staticmethod
    def usage() -> Call:
        return Call("GET", "/v1/usage", s.Usage)

    @staticmethod
    def upload_dataset(archive: bytes, repo_id: str) -> Call:
        params = {"repo_id": repo_id}
        return Call("POST", "/v1/datasets", s.DatasetInfo, params=params, content=archive)

    @staticmethod
    def datasets() -> Call:
        return Call("GET", "/v1/datasets", list[s.DatasetInfo])

    @staticmethod
    def delete_dataset(dataset_id: str) -> Call:
        return Call("DELETE", f"/v1/datasets/{dataset_id}", s.DatasetDeleted)

    @staticmethod
    def train_batch(images: Any, state: Any, action: Any, action_is_pad: Any, instructions: Any) -> Call:
        body = s.SampleBatch(**_samples(images, state, action, action_is_pad, instructions))
        return Call("POST", "/v1/train_batch", s.TrainStepResult, body)

    @staticmethod
    def forward_backward(
        images: Any,
        state: Any,
        action: Any,
        action_is_pad: Any,
        instructions: Any,
        loss: str,
        advantages: Any,
        sampling_logprobs: Any = None,
        loss_config: dict[str, Any] | None = None,
    ) -> Call:
        body = s.ForwardBackwardRequest(
            **_samples(images, state, action, action_is_pad, instructions),
            loss=loss,
            advantages=_tensor(advantages, "advantages"),
            sampling_logprobs=_tensor(sampling_logprobs, "sampling_logprobs"),
            loss_config=loss_config,
        )
        return Call("POST", "/v1/forward_backward", s.ForwardBackwardResult, body)

    @staticmethod
    def optim_step(
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        weight_decay: float | None = None,
        grad_clip: float | None = None,
    ) -> Call:
        body = s.OptimStepRequest(lr=lr, betas=betas, weight_decay=weight_decay, grad_clip=grad_clip)
        return Call("POST", "/v1/optim_step", s.OptimStepResult, body)

    @staticmethod
    def load_state(version: int) -> Call:
        return Call("POST", "/v1/load_state", sc.LoadStateResult, sc.LoadStateRequest(version=version))

    @staticmethod
    def fork(new_tenant: str, version: int | None, learning_rate: float | None, seed: int | None) -> Call:
        overrides = {"learning_rate": learning_rate, "seed": seed}  # checked as part of the body: full field paths
        body = sc.ForkRequest.model_validate({"new_tenant": new_tenant, "version": version, "overrides": overrides})
        return Call("POST", "/v1/fork", sc.TenantForked, body)

    @staticmethod
    def predict(
        images: Any,
        state: Any,
        instructions: Any,
        policy_version: Any,
        seeds: Any,
        session_id: Any,
        sample: bool,
        timeout_s: float,
    ) -> Call:
        body = s.PredictRequest(
            observations=s.ObservationBatch(
                images=_tensor(images, "images", "image"), state=_tensor(state, "state"), instructions=instructions
            ),
            policy_version=policy_version,
            seeds=seeds,
            session_id=session_id,
            sample=sample,
            timeout_s=timeout_s,
        )
        return Call("POST", "/v1/predict", s.PredictResult, body)

    @staticmethod
    def load_weights(payload: bytes | None, version: int | None) -> Call:
        return Call(
            "POST", "/v1/weights/load", s.LoadWeightsResult, s.LoadWeightsRequest(payload=payload, version=version)
        )

    @staticmethod
    def save(include_optim: bool) -> Call:
        return Call("POST", "/v1/save", s.Manifest, s.SaveRequest(include_optim=include_optim))

    @staticmethod
    def queue_put(partition: str, columns: dict[str, Any], indices: list[int] | None, task_name: str) -> Call:
        body = s.QueuePut(columns=_columns(columns), indices=indices, task_name=task_name)
        return Call("POST", f"/v1/queue/partitions/{partition}", s.PartitionInfo, body)

    @staticmethod
    def queue_get(partition: str, fields: list[str], batch_size: int, task_name: str) -> Call:
        body = s.QueueGet(fields=fields, batch_size=batch_size, task_name=task_name)
        return Call("POST", f"/v1/queue/partitions/{partition}/get", s.QueueBatch, body)

    @staticmethod
    def queue_describe(partition: str) -> Call:
        return Call("GET", f"/v1/queue/partitions/{partition}", s.PartitionInfo)

    @staticmethod
    def queue_partitions() -> Call:
        return Call("GET", "/v1/queue/partitions", list[s.PartitionInfo])

    @staticmethod
    def queue_clear(partition: str) -> Call:
        return Call("DELETE", f"/v1/queue/partitions/{partition}", s.Cleared)

    @staticmethod
    def open_session(config: dict[str, Any], rollout_id: str) -> Call:
        return Call("POST", "/v1/env/sessions", s.SessionInfo, s.SessionOpen(config=config, rollout_id=rollout_id))

    @staticmethod
    def sessions() -> Call:
        return Call("GET", "/v1/env/sessions", s.SessionList)

    @staticmethod
    def reset(session_id: str, seed: int | None) -> Call:
        return Call("POST", f"/v1/env/sessions/{session_id}/reset", s.EnvResult, s.EnvReset(seed=seed))

    @staticmethod
    def step(session_id: str, action: Any) -> Call:
        body = s.EnvStep(action=_tensor(action, "action"))
        return Call("POST", f"/v1/env/sessions/{session_id}/step", s.EnvResult, body)

    @staticmethod
    def close_session(session_id: str) -> Call:
        return Call("DELETE", f"/v1/env/sessions/{session_id}", s.Cleared)

    # admin
    @staticmethod
    def create_tenant(spec: Any, issue_key: bool) -> Call:
        return Call("POST", "/v1/admin/tenants", s.TenantCreated, _spec_dict(spec), params={"issue_key": issue_key})

    @staticmethod
    def tenants() -> Call:
        return Call("GET", "/v1/admin/tenants", list[s.TenantInfo])

    @staticmethod
    def issue_key(tenant_id: str, label: str) -> Call:
        return Call("POST", f"/v1/admin/tenants/{tenant_id}/keys", s.IssuedKey, s.IssueKeyRequest(label=label))

    @staticmethod
    def revoke_key(key_id: str) -> Call:
        return Call("DELETE", f"/v1/admin/keys/{key_id}", s.KeyInfo)

    @staticmethod
    def delete_tenant(tenant_id: str, delete_artifacts: bool) -> Call:
        params = {"delete_artifacts": delete_artifacts}
        return Call("DELETE", f"/v1/admin/tenants/{tenant_id}", s.TenantDeleted, params=params)

    @staticmethod
    def purge_tenant_artifacts(tenant_id: str) -> Call:
        return Call("DELETE", f"/v1/admin/tenants/{tenant_id}/artifacts", s.TenantDeleted)

    @staticmethod
    def set_quota(
        tenant_id: str,
        max_device_seconds: float | None,
        max_queued_workloads: int | None,
        max_storage_bytes: int | None = None,
    ) -> Call:
        body = s.QuotaUpdate(
            max_device_seconds=max_device_seconds,
            max_queued_workloads=max_queued_workloads,
            max_storage_bytes=max_storage_bytes,
        )
        return Call("PUT", f"/v1/admin/tenants/{tenant_id}/quota", s.Quota, body.model_dump())

    @staticmethod
    def all_usage() -> Call:
        return Call("GET", "/v1/admin/usage", list[s.Usage])


def next_versions_page(pages: list[s.Versions], after: int | None) -> int | None:
    """The `after` of the next page, or None when the last one is in (or the server does not move on)."""
    nxt = pages[-1].next_after
    return nxt if nxt is not None and (after is None or nxt > after) else None


def merged_versions(pages: list[s.Versions]) -> s.Versions:
    """Every page's checkpoints under the last page's (freshest) training and serving state."""
    return pages[-1].model_copy(update={"checkpoints": [c for p in pages for c in p.checkpoints], "next_after": None})
