"""MLflow experiment tracking and the per-tenant model registry.

Only ``MlflowClient`` is used, never the fluent ``mlflow.start_run`` globals: the fluent API keeps
one active run per thread/process, while this service trains many tenants at once.

Quirks handled here (MLflow 3.x, see /work/shared/STACK.md):
* ``mlflow.register_model`` on a plain artifact folder fails in 3.x, so versions are created with
  ``MlflowClient.create_model_version(name, source=<artifact uri>, run_id=...)``.
* A sqlite tracking store defaults artifacts to ``./mlruns`` under the *current directory*; the
  tracker instead puts them beside the database unless told otherwise.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

from mlflow.entities import Metric, Param
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.tracking import MlflowClient

from joynexus.artifacts import (
    ACTION_MODULE_FILE,
    DATASET_SHA256_KEY,
    MANIFEST_FILE,
    PayloadError,
    TenantManifest,
    decode_tenant_payload,
    payload_digest,
    validate_tenant_id,
)
from joynexus.artifacts.codec import NORMALIZATION_FILE
from joynexus.data.normalization import Normalizer

__all__ = [
    "CANDIDATE_ALIAS",
    "CHAMPION_ALIAS",
    "PAYLOAD_ARTIFACT_DIR",
    "ExperimentTracker",
    "PromotionDecision",
    "RegistryError",
    "promote",
    "registered_model_name",
]

PAYLOAD_ARTIFACT_DIR = "tenant_payload"
# Registry lifecycle: every new version becomes the candidate; the champion is what serves and what
# the periodic evaluation watches, moved only by `promote` when a candidate beats it.
CANDIDATE_ALIAS = "candidate"
CHAMPION_ALIAS = "champion"
EVAL_TASK_TAG = "eval"  # tags.task of evaluation workload runs (joynexus.master.workloads.evaluation)
COMPARISON_TASK_TAG = "evaluation-declaration"  # tags.task of a declaration's comparison run
COMPARISON_TABLE_FILE = "comparison.json"
HISTORY_TASK_TAG = "evaluation-history"  # tags.task of the per-tenant periodic-evaluation run
# MLflow's per-request caps on log_batch (params / metrics).
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_END_STATUSES = {"FINISHED", "FAILED", "KILLED"}
_T = TypeVar("_T")


class RegistryError(RuntimeError):
    """A registered tenant payload is missing, belongs to another tenant, or fails verification."""


def registered_model_name(tenant_id: str) -> str:
    """One registered model per tenant: ``joynexus-<tenant_id>-policy``."""
    return f"joynexus-{validate_tenant_id(tenant_id)}-policy"


def _default_artifact_location(tracking_uri: str) -> str | None:
    # sqlite:////abs/dir/mlflow.db -> file:///abs/dir/artifacts (instead of MLflow's ./mlruns).
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    # "sqlite:////abs/x.db" -> "/abs/x.db" (absolute); "sqlite:///rel/x.db" -> "rel/x.db".
    db_path = unquote(tracking_uri[len(prefix) :].split("?", 1)[0])
    if not db_path or db_path == ":memory:":
        return None
    artifacts = Path(db_path).resolve().parent / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    return artifacts.as_uri()


def _chunks(items: list[_T], size: int) -> Iterable[list[_T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _param_value(value: Any) -> str:
    # MLflow params are strings; structured values stay readable and parseable as JSON.
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def _is_already_exists(exc: MlflowException) -> bool:
    return exc.error_code == ErrorCode.Name(RESOURCE_ALREADY_EXISTS)


class ExperimentTracker:
    """Thread-safe wrapper over ``MlflowClient`` for workload runs and tenant policy versions."""

    def __init__(
        self,
        tracking_uri: str,
        artifact_location: str | None = None,
        experiment_name: str = "joynexus",
    ) -> None:
        self.tracking_uri = tracking_uri
        # Registry lives in the same store as tracking (one embedded DB by default).
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.experiment_name = experiment_name
        if artifact_location is None:
            artifact_location = _default_artifact_location(tracking_uri)
        self.experiment_id = self._ensure_experiment(experiment_name, artifact_location)
        # Serialises register calls per process so the "create registered model if missing"
        # check and same-run artifact folder checks do not race between our own threads.
        self._register_lock = threading.Lock()

    def _ensure_experiment(self, name: str, artifact_location: str | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:
            # Another process/thread may have created it between our get and create.
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    # ---- runs --------------------------------------------------------------------------

    def start_workload_run(
        self,
        tenant_id: str,
        workload_id: str,
        params: dict[str, Any],
        tags: dict[str, str] | None = None,
    ) -> str:
        """Create a run tagged with ``tenant_id`` / ``workload_id``, log ``params``; return its id."""
        validate_tenant_id(tenant_id)
        run_tags = {str(k): str(v) for k, v in (tags or {}).items()}
        run_tags.update({"tenant_id": tenant_id, "workload_id": str(workload_id)})
        run = self.client.create_run(self.experiment_id, tags=run_tags, run_name=f"{tenant_id}-{workload_id}")
        run_id = run.info.run_id
        param_list = [Param(str(k), _param_value(v)) for k, v in params.items()]
        for chunk in _chunks(param_list, _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk)
        return run_id

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        """Log several metrics at one step in a single batch call."""
        ts = int(time.time() * 1000)
        items = [Metric(str(k), float(v), ts, int(step)) for k, v in metrics.items()]
        for chunk in _chunks(items, _MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=chunk)

    def log_metric_points(self, run_id: str, points: list[tuple[str, float, int]]) -> None:
        """Log (key, value, step) points of any keys in as few batch calls as MLflow allows: each
        call is a store transaction, so a job's metrics go in one call, not one per kind."""
        ts = int(time.time() * 1000)
        items = [Metric(str(key), float(value), ts, int(step)) for key, value, step in points]
        for chunk in _chunks(items, _MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=chunk)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Terminate a run; ``status`` is one of FINISHED, FAILED, KILLED."""
        if status not in _END_STATUSES:
            raise ValueError(f"run status must be one of {sorted(_END_STATUSES)}, got {status!r}")
        self.client.set_terminated(run_id, status=status)

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """``[(step, value), ...]`` ordered by step (then log time)."""
        history = self.client.get_metric_history(run_id, key)
        history = sorted(history, key=lambda m: (m.step, m.timestamp))
        return [(int(m.step), float(m.value)) for m in history]

    # ---- registry ----------------------------------------------------------------------

    def _ensure_registered_model(self, name: str, tenant_id: str) -> None:
        try:
            self.client.create_registered_model(
                name,
                tags={"tenant_id": tenant_id, "joynexus.kind": "tenant-policy"},
                description=f"JoyNexus action-module policy versions for tenant {tenant_id}",
            )
        except MlflowException as exc:
            if not _is_already_exists(exc):
                raise

    def delete_tenant_model(self, tenant_id: str) -> int:
        """Delete the tenant's registered model with every version (tenant deletion with its
        artifacts); returns how many versions it had, 0 if it had none."""
        name = registered_model_name(tenant_id)
        try:
            count = len(self.client.search_model_versions(f"name = '{name}'"))
            self.client.delete_registered_model(name)
        except MlflowException as exc:
            if "RESOURCE_DOES_NOT_EXIST" in str(exc) or "not found" in str(exc).lower():
                return 0
            raise
        return count

    def register_tenant_payload(
        self,
        *,
        run_id: str,
        tenant_id: str,
        payload: bytes,
        manifest: TenantManifest,
    ) -> int:
        """Log ``payload`` + manifest as run artifacts and register them as a new model version.

        Artifacts go to ``tenant_payload/v<policy_version:06d>/`` inside the run, so one run may
        register several policy versions without overwriting the files an earlier version points to.
        The version is tagged with the export's digests: ``manifest_digest`` (the manifest's, what the
        API's ``X-JoyNexus-Manifest-Digest`` says) and ``payload_sha256`` (the payload's bytes).
        Exports of one policy version are byte-identical, so a later export of the same version
        matches both tags. Returns the new registry version number.

        Idempotent: registering again what this run already registered for that policy version (the
        same manifest digest) returns the existing registry version, so a Master restarted mid-publish
        completes the workload instead of failing it; a different payload for that version is refused.
        """
        validate_tenant_id(tenant_id)
        if manifest.tenant_id != tenant_id:
            raise ValueError(f"manifest is for tenant {manifest.tenant_id!r}, not {tenant_id!r}")
        # Refuse to register bytes that would fail to load later.
        try:
            _, embedded = decode_tenant_payload(payload)
        except PayloadError as exc:
            raise ValueError(f"payload for tenant {tenant_id!r} is not a valid tenant payload: {exc}") from exc
        if embedded.digest != manifest.digest:
            raise ValueError(
                f"payload for tenant {tenant_id!r} embeds manifest {embedded.digest[:12]}..., "
                f"but manifest {manifest.digest[:12]}... was given"
            )
        run = self.client.get_run(run_id)
        run_tenant = run.data.tags.get("tenant_id")
        if run_tenant is not None and run_tenant != tenant_id:
            raise ValueError(f"run {run_id} belongs to tenant {run_tenant!r}, not {tenant_id!r}")

        artifact_path = f"{PAYLOAD_ARTIFACT_DIR}/v{manifest.policy_version:06d}"
        name = registered_model_name(tenant_id)
        normalizer = Normalizer.from_dict(manifest.extra.get("normalization"))
        with self._register_lock:
            logged = bool(self.client.list_artifacts(run_id, artifact_path))
            if logged:
                existing = self._registered_before(name, run_id, artifact_path, payload, manifest)
                if existing is not None:
                    return existing
            else:
                self._log_payload(run_id, artifact_path, payload, manifest, normalizer)
            source = f"{run.info.artifact_uri.rstrip('/')}/{artifact_path}"
            self._ensure_registered_model(name, tenant_id)
            mv = self.client.create_model_version(
                name=name,
                source=source,
                run_id=run_id,
                tags={
                    "tenant_id": tenant_id,
                    "policy_version": str(manifest.policy_version),
                    "schema_signature": manifest.schema_signature,
                    "base_model_id": manifest.base_model_id,
                    "manifest_digest": manifest.digest,
                    "payload_sha256": payload_digest(payload),
                    **(normalizer.tags() if normalizer is not None else {}),
                    **_dataset_tags(manifest),
                },
                description=f"tenant {tenant_id} policy_version {manifest.policy_version}",
            )
        return int(mv.version)

    def _log_payload(
        self, run_id: str, artifact_path: str, payload: bytes, manifest: TenantManifest, normalizer: Normalizer | None
    ) -> None:
        """The payload, its manifest and (if any) its normalizer as the run's artifacts under `artifact_path`."""
        with tempfile.TemporaryDirectory(prefix="joynexus-payload-") as tmp:
            (Path(tmp) / ACTION_MODULE_FILE).write_bytes(bytes(payload))
            (Path(tmp) / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
            if normalizer is not None:  # the statistics that turn the module's actions into dataset units
                (Path(tmp) / NORMALIZATION_FILE).write_text(normalizer.to_json(), encoding="utf-8")
            self.client.log_artifacts(run_id, tmp, artifact_path=artifact_path)

    def _registered_before(
        self, name: str, run_id: str, artifact_path: str, payload: bytes, manifest: TenantManifest
    ) -> int | None:
        """The run already holds a payload for this policy version: its registry version if it is
        these bytes with this manifest (None: the artifacts are there but the version was never
        created, e.g. the Master died between the two); anything else is refused (artifacts are
        immutable). The manifest alone does not cover the tensors, so the payload digest counts too."""
        digest = payload_digest(payload)  # the payload embeds its manifest: equal bytes, equal manifest
        refused = ValueError(
            f"run {run_id} already holds a different payload for tenant {manifest.tenant_id!r} "
            f"policy_version {manifest.policy_version} (artifacts are immutable)"
        )
        for mv in self.client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
            if mv.tags.get("policy_version") != str(manifest.policy_version):
                continue
            if (mv.tags.get("manifest_digest"), mv.tags.get("payload_sha256")) != (manifest.digest, digest):
                raise refused
            return int(mv.version)
        with tempfile.TemporaryDirectory(prefix="joynexus-payload-") as tmp:
            local = self.client.download_artifacts(run_id, f"{artifact_path}/{ACTION_MODULE_FILE}", tmp)
            logged = Path(local).read_bytes()
        if payload_digest(logged) != digest:
            raise refused
        return None

    def set_alias(self, tenant_id: str, alias: str, version: int) -> None:
        """Point ``alias`` (e.g. "production") of the tenant's model at ``version`` (moves it if set)."""
        self.client.set_registered_model_alias(registered_model_name(tenant_id), alias, str(int(version)))

    def _resolve_version(self, tenant_id: str, version: int | None, alias: str | None) -> ModelVersion:
        name = registered_model_name(tenant_id)
        if version is not None and alias is not None:
            raise ValueError("pass either version or alias, not both")
        if alias is not None:
            return self.client.get_model_version_by_alias(name, alias)
        if version is not None:
            return self.client.get_model_version(name, str(int(version)))
        versions = self.client.search_model_versions(f"name = '{name}'")
        if not versions:
            raise RegistryError(f"tenant {tenant_id!r} has no registered policy versions")
        return max(versions, key=lambda v: int(v.version))

    def fetch_tenant_payload(
        self,
        tenant_id: str,
        *,
        version: int | None = None,
        alias: str | None = None,
    ) -> tuple[bytes, TenantManifest]:
        """Download a registered version (by number, alias, or newest) and verify it.

        The payload must decode, its embedded manifest must equal ``manifest.json``, and both must
        match the ``manifest_digest`` tag written at registration; the payload's bytes must match the
        ``payload_sha256`` tag (versions registered before that tag existed have none to check).
        """
        mv = self._resolve_version(tenant_id, version, alias)
        where = f"tenant {tenant_id!r} model version {mv.version}"
        tags = dict(mv.tags or {})
        if tags.get("tenant_id") != tenant_id:
            raise RegistryError(f"{where} is tagged for tenant {tags.get('tenant_id')!r}")
        expected_digest = tags.get("manifest_digest")
        if not expected_digest:
            raise RegistryError(f"{where} has no manifest_digest tag")
        with tempfile.TemporaryDirectory(prefix="joynexus-fetch-") as tmp:
            # Download from the version's own source URI: it is what the registry points at.
            repo = get_artifact_repository(mv.source, tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
            local = Path(repo.download_artifacts("", dst_path=tmp))
            try:
                payload = (local / ACTION_MODULE_FILE).read_bytes()
                manifest_text = (local / MANIFEST_FILE).read_text(encoding="utf-8")
            except FileNotFoundError as exc:
                raise RegistryError(f"{where}: artifact {Path(exc.filename).name} missing at {mv.source}") from exc
        try:
            _, embedded = decode_tenant_payload(payload)
        except PayloadError as exc:
            raise RegistryError(f"{where}: {ACTION_MODULE_FILE} is not a valid payload: {exc}") from exc
        stored = TenantManifest.from_json(manifest_text)
        if embedded.digest != expected_digest or stored.digest != expected_digest:
            raise RegistryError(
                f"{where}: manifest digest mismatch (tag {expected_digest}, payload {embedded.digest}, "
                f"{MANIFEST_FILE} {stored.digest})"
            )
        expected_sha = tags.get("payload_sha256")
        if expected_sha is not None and payload_digest(payload) != expected_sha:
            raise RegistryError(
                f"{where}: {ACTION_MODULE_FILE} bytes do not match the payload_sha256 tag "
                f"(tag {expected_sha}, file {payload_digest(payload)})"
            )
        return payload, embedded

    def model_version_tags(self, tenant_id: str, version: int) -> dict[str, str]:
        """Tags of one registered version (tenant_id, policy_version, manifest_digest, ...)."""
        mv = self.client.get_model_version(registered_model_name(tenant_id), str(int(version)))
        return dict(mv.tags or {})

    # ---- registry lifecycle: aliases, evaluations, promotion -------------------------------

    def alias_version(self, tenant_id: str, alias: str) -> int | None:
        """The version ``alias`` points at, or None if the alias (or the tenant's model) is not set."""
        try:
            model = self.client.get_registered_model(registered_model_name(tenant_id))
        except MlflowException as exc:
            if exc.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                return None
            raise
        version = (model.aliases or {}).get(alias)
        return int(version) if version is not None else None

    def evaluation_metric(self, tenant_id: str, version: int, metric: str) -> float | None:
        """``metric`` of the newest finished evaluation run of registry ``version`` (matched by the
        version's ``policy_version`` tag), or None if it was never evaluated."""
        tags = self.model_version_tags(tenant_id, version)
        policy_version = tags.get("policy_version")
        if policy_version is None or not policy_version.isdigit():
            raise RegistryError(f"tenant {tenant_id!r} model version {version} has no policy_version tag")
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=(
                f"tags.tenant_id = '{validate_tenant_id(tenant_id)}' and tags.task = '{EVAL_TASK_TAG}' "
                f"and params.policy_version = '{policy_version}' and attributes.status = 'FINISHED'"
            ),
            order_by=["attributes.end_time DESC"],
            max_results=20,
        )
        for run in runs:  # newest first; an evaluation that failed to log the metric is skipped
            if metric in run.data.metrics:
                return float(run.data.metrics[metric])
        # An evaluation that runs no workload (the held-out loss) is logged on the version itself.
        logged = tags.get(metric)
        try:
            return float(logged) if logged is not None else None
        except ValueError:
            return None

    def log_version_evaluation(self, tenant_id: str, version: int, metrics: dict[str, float]) -> None:
        """Attach evaluation metrics to registry ``version``: as tags of the version (what
        `evaluation_metric` and the MLflow UI's version page read) and as metrics of the run that
        registered it, at step = its policy version."""
        name = registered_model_name(tenant_id)
        mv = self.client.get_model_version(name, str(int(version)))
        self.set_version_tags(tenant_id, version, {key: float(value) for key, value in metrics.items()})
        if mv.run_id:
            step = int((mv.tags or {}).get("policy_version", 0) or 0)
            self.log_metrics(mv.run_id, {key: float(value) for key, value in metrics.items()}, step=step)

    def set_version_tags(self, tenant_id: str, version: int, tags: dict[str, Any]) -> None:
        name = registered_model_name(tenant_id)
        for key, value in tags.items():
            self.client.set_model_version_tag(name, str(int(version)), str(key), _param_value(value))

    def log_evaluation_history(self, tenant_id: str, version: int, metrics: dict[str, float]) -> str:
        """Append one point to the tenant's evaluation history: ONE long-lived run per tenant
        (``<tenant>-evaluation-history``), step = number of earlier points, with the evaluated
        registry version logged beside the metrics. Returns the run id."""
        validate_tenant_id(tenant_id)
        with self._register_lock:
            runs = self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.tenant_id = '{tenant_id}' and tags.task = '{HISTORY_TASK_TAG}'",
                order_by=["attributes.start_time ASC"],
                max_results=1,
            )
            if runs:
                run_id = runs[0].info.run_id
            else:
                run = self.client.create_run(
                    self.experiment_id,
                    tags={"tenant_id": tenant_id, "task": HISTORY_TASK_TAG},
                    run_name=f"{tenant_id}-evaluation-history",
                )
                run_id = run.info.run_id
            step = len(self.client.get_metric_history(run_id, "registry_version"))
            self.log_metrics(run_id, {**metrics, "registry_version": float(version)}, step=step)
            self.client.set_terminated(run_id, status="FINISHED")  # a finished run still takes points
        return run_id

    def log_comparison_table(self, declaration_id: str, rows: list[dict[str, Any]], tags: dict[str, str]) -> str:
        """An evaluation declaration's comparison table (one row per target tenant and version) as
        ONE run with the table artifact ``comparison.json`` (`MlflowClient.log_table`). Returns the run id."""
        run = self.client.create_run(
            self.experiment_id,
            tags={**tags, "task": COMPARISON_TASK_TAG, "declaration_id": declaration_id},
            run_name=f"evaluation-{declaration_id}",
        )
        columns = sorted({key for row in rows for key in row})
        data = {key: [row.get(key) for row in rows] for key in columns}
        self.client.log_table(run.info.run_id, data=data, artifact_file=COMPARISON_TABLE_FILE)
        self.client.set_terminated(run.info.run_id, status="FINISHED")
        return run.info.run_id


@dataclass(frozen=True)
class PromotionDecision:
    """What `promote` did, and why."""

    tenant_id: str
    version: int
    metric: str
    value: float | None  # the new version's evaluation (None: never evaluated)
    previous_champion: int | None
    champion_value: float | None
    champion: int  # the champion after the decision
    promoted: bool  # True if `version` is now the champion
    reason: str


def promote(
    tracker: ExperimentTracker,
    tenant_id: str,
    version: int,
    *,
    metric: str = "eval/success_rate",
    higher_is_better: bool = True,
    min_improvement: float = 0.0,
    champion_metric: str | None = None,
) -> PromotionDecision:
    """The promotion rule: ``candidate`` always moves to ``version``; ``champion`` moves to it only
    when there is no champion yet, or when its evaluation beats the champion's by more than
    ``min_improvement`` (in the direction ``higher_is_better`` says). Evaluations are the newest
    finished evaluation runs of each version (`ExperimentTracker.evaluation_metric`). A version that
    was never evaluated can not beat an evaluated champion; one with an unevaluated champion wins.
    The decision is also written as tags on ``version`` (visible in the MLflow UI).
    ``champion_metric``: the champion's measurement is read from this metric instead (the interval
    rule: the candidate's success lower bound against the champion's success rate)."""
    if min_improvement < 0:
        raise ValueError(f"min_improvement: expected >= 0, got {min_improvement}")
    version = int(version)
    tracker.model_version_tags(tenant_id, version)  # raises if the version does not exist
    tracker.set_alias(tenant_id, CANDIDATE_ALIAS, version)
    value = tracker.evaluation_metric(tenant_id, version, metric)
    champion = tracker.alias_version(tenant_id, CHAMPION_ALIAS)
    champion_value = None
    if champion is None:
        promoted, reason = True, "no champion yet"
    elif champion == version:
        promoted, reason = True, "already the champion"
    else:
        theirs = champion_metric or metric
        champion_value = tracker.evaluation_metric(tenant_id, champion, theirs)
        if value is None:
            promoted, reason = False, f"version {version} has no {metric} evaluation"
        elif champion_value is None:
            promoted, reason = True, f"champion v{champion} has no {theirs} evaluation"
        else:
            gain = value - champion_value if higher_is_better else champion_value - value
            promoted = gain > min_improvement
            relation = "beats" if promoted else "does not beat"
            reason = (
                f"{metric} {value:.4g} {relation} champion v{champion}'s {theirs} {champion_value:.4g} "
                f"by more than {min_improvement:g} ({'higher' if higher_is_better else 'lower'} is better)"
            )
    if promoted:
        tracker.set_alias(tenant_id, CHAMPION_ALIAS, version)
    decision = PromotionDecision(
        tenant_id=tenant_id,
        version=version,
        metric=metric,
        value=value,
        previous_champion=champion,
        champion_value=champion_value,
        champion=version if promoted else int(champion),  # champion is None only when promoted
        promoted=promoted,
        reason=reason,
    )
    tags: dict[str, Any] = {"promotion": "champion" if promoted else "candidate", "promotion_reason": reason}
    if value is not None:
        tags[metric] = value
    tracker.set_version_tags(tenant_id, version, tags)
    return decision


def _dataset_tags(manifest: TenantManifest) -> dict[str, str]:
    """The data that trained a version (its manifest's dataset digests) as registry tags."""
    digest = manifest.extra.get(DATASET_SHA256_KEY)
    datasets = manifest.extra.get("datasets")
    tags = {DATASET_SHA256_KEY: digest} if isinstance(digest, str) else {}
    if isinstance(datasets, list) and datasets:
        tags["datasets"] = ",".join(str(d) for d in datasets)  # 65 characters each; MLflow keeps 5,000
    return tags


def tracker_from_settings(settings: Any) -> ExperimentTracker:
    """The deployment's tracker (`joynexus.settings.Settings`): its MLflow URI, and where its
    artifacts live (the configured S3 bucket, the tracking server's choice, or the data dir)."""
    from joynexus.settings import local_artifact_location

    location: str | None
    if settings.mlflow_artifact_location:  # an S3 bucket is configured: MLflow artifacts go there too
        from joynexus.artifacts.s3 import configure_mlflow_s3

        configure_mlflow_s3(settings.s3_endpoint_url)
        location = settings.mlflow_artifact_location
    elif settings.mlflow_tracking_uri:
        location = None  # a tracking server decides where artifacts live
    else:
        location = local_artifact_location(settings.data_dir)
    return ExperimentTracker(settings.resolved_mlflow_uri(), artifact_location=location)
