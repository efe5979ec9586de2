"""What the users named in the mission see, in a real browser (issue 30): headless Chromium opens the
Prefect UI and the MLflow UI of a deployment `joynexus up` started, after a lifecycle flow and the
main job ran on it, and checks what a person would look for: the flow run (state, task runs, the
markdown artifact), each tenant's registered model with its `candidate` / `champion` aliases and
version tags, and the training run's loss curve. Screenshots go to `test-artifacts/ui/` (or
`$JOYNEXUS_TEST_ARTIFACTS/ui/`); the folder is printed.

Needs Debian's chromium and chromedriver (`scripts/install-browser`, as root) and selenium (the `dev`
extra); skipped, naming what is missing, without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import sft_spec, write_dataset_for

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
LIFECYCLE_TENANT = "ui-lifecycle"
LOSS_METRIC = "train/loss"
PAGE_TIMEOUT_S = 90.0

pytestmark = [
    pytest.mark.slow,
    # the first test also brings the deployment up and runs the flow and the main job (~4 min idle)
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
        reason=f"needs Debian's chromium ({CHROMIUM}) and chromedriver ({CHROMEDRIVER}): run scripts/install-browser",
    ),
]


def artifacts_dir() -> Path:
    base = os.environ.get("JOYNEXUS_TEST_ARTIFACTS")
    folder = (Path(base) if base else ROOT / "test-artifacts") / "ui"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ------------------------------------------------------------------------------------------------
# The deployment: `joynexus up`, a lifecycle flow and the main job as a user runs them (README)
# ------------------------------------------------------------------------------------------------


def _run(argv: list[str], env: dict[str, str], log: Path, timeout_s: float = 1200.0) -> str:
    """Run a command as the README does, from the repository root; its output goes to `log`."""
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    output = done.stdout + done.stderr
    log.write_text(output)
    print(f"{' '.join(argv[1:])}: exit {done.returncode} in {time.monotonic() - started:.0f} s (log {log})")
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{output[-4000:]}"
    return output


def _ray_port(settings_fields: dict[str, Any]) -> int:
    """A Ray head port whose whole block (it and the BLOCK_SIZE - 1 above) is free, outside Ray's worker range."""
    from joynexus.ops.ray_ports import BLOCK_SIZE, ray_ports
    from joynexus.ops.supervisor import HOST, free_port
    from joynexus.settings import Settings

    for _ in range(20):
        port = free_port()
        settings = Settings(**settings_fields, ray_port=port)
        if port + BLOCK_SIZE <= 65535 and not ray_ports(settings).busy(HOST):
            return port
    raise RuntimeError(f"no free block of {BLOCK_SIZE} ports for the Ray head")


class Deployment:
    """What the UIs are checked against: the endpoints `up` recorded and what ran on them."""

    def __init__(self, state: Any, env: dict[str, str]):
        self.state, self.env = state, env
        self.prefect_ui = state.prefect_api_url.removesuffix("/api")
        self.mlflow_ui = state.mlflow_tracking_uri

    def prefect(self, path: str, body: dict[str, Any]) -> Any:
        import httpx

        response = httpx.post(f"{self.state.prefect_api_url}{path}", json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    def mlflow(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.state.mlflow_tracking_uri)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    from joynexus.ops.supervisor import down, free_port, up
    from joynexus.settings import Settings

    root = tmp_path_factory.mktemp("ui")
    fields: dict[str, Any] = {
        "data_dir": root / "data",
        "prefect_port": free_port(),
        "mlflow_port": free_port(),
        "torch_threads": 1,
        "ray_namespace": f"ui-{os.getpid()}",
    }
    settings = Settings(**fields, ray_port=_ray_port(fields))
    started = time.monotonic()
    # a generous limit: on a busy 2-core host, loading the services has taken over 300 s
    state = up(settings, timeout_s=900.0, on_stage=lambda message: print(f"up: {message}"))
    print(f"joynexus up: {time.monotonic() - started:.0f} s")
    try:
        env = {**os.environ, **state.exports(), "PREFECT_HOME": str(root / "prefect-client")}
        env.update(JOYNEXUS_RAY_NAMESPACE=settings.ray_namespace, JOYNEXUS_TORCH_THREADS="1")
        spec = sft_spec(
            LIFECYCLE_TENANT, root / "datasets" / LIFECYCLE_TENANT, jobs=2, samples_per_job=16, microbatch_size=8
        )
        spec["dataset"]["validation_episodes"] = 1  # promotion by held-out loss: an evaluation to show
        write_dataset_for(spec, episodes=3, length=12)
        (root / "spec.yaml").write_text(json.dumps(spec))  # JSON is YAML
        python = sys.executable
        _run([python, "-m", "flows.tenant_lifecycle", str(root / "spec.yaml")], env, root / "lifecycle.log")
        _run(
            [python, "-m", "recipes.main_job", "--no-simulators", "--jobs", "2", "--samples-per-job", "16"],
            env, root / "main-job.log",
        )  # fmt: skip
        yield Deployment(state, env)
    finally:
        down(settings)


# ------------------------------------------------------------------------------------------------
# The browser: headless Chromium through Debian's chromedriver
# ------------------------------------------------------------------------------------------------


class Browser:
    """A headless Chromium page that waits for what a person would read on the (single-page) UIs,
    and saves a screenshot of each view; a view that never shows it leaves a `-failed` screenshot
    and the page's text beside it."""

    def __init__(self, driver: Any, folder: Path):
        self.driver, self.folder = driver, folder
        self.saved: list[Path] = []

    def open(self, url: str) -> None:
        # A fresh document each time: from one `#/...` route to another, Chromium only changes the
        # hash, and MLflow's model page then keeps the previous model's (empty) versions table.
        self.driver.get("about:blank")
        self.driver.get(url)

    def text(self) -> str:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.TAG_NAME, "body").text

    def wait_for(self, name: str, what: str, ready: Callable[[Any], Any], timeout_s: float = PAGE_TIMEOUT_S) -> Any:
        """Wait until `ready(driver)` is truthy (its value is returned), then screenshot `name`."""
        from selenium.common.exceptions import TimeoutException, WebDriverException
        from selenium.webdriver.support.ui import WebDriverWait

        def probe(driver: Any) -> Any:
            try:
                return ready(driver)
            except WebDriverException:  # an element replaced while the SPA re-renders: look again
                return None

        try:
            found = WebDriverWait(self.driver, timeout_s, poll_frequency=0.5).until(probe)
        except TimeoutException:
            self.screenshot(f"{name}-failed")
            (self.folder / f"{name}-failed.txt").write_text(f"{self.driver.current_url}\n\n{self.text()}")
            raise AssertionError(
                f"{name}: {what} not shown after {timeout_s:.0f} s at {self.driver.current_url}; "
                f"see {self.folder / (name + '-failed.png')}"
            ) from None
        time.sleep(1.0)  # let charts and fonts finish painting before the picture
        self.screenshot(name)
        return found

    def wait_for_text(self, name: str, *texts: str) -> str:
        """Wait until every one of `texts` is in the page's visible text; returns that text."""

        def shown(driver: Any) -> str | None:
            page = self.text()
            return page if all(text in page for text in texts) else None

        return self.wait_for(name, f"text {texts}", shown)

    def screenshot(self, name: str) -> None:
        path = self.folder / f"{name}.png"
        self.driver.save_screenshot(str(path))
        self.saved.append(path)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    pytest.importorskip("selenium", reason="selenium (pyproject's dev extra) is not installed: run scripts/bootstrap")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1600,1100", "--lang=en-US"):  # fmt: skip
        options.add_argument(argument)
    # Debian's driver, given by path: selenium's own manager downloads nothing.
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    folder = artifacts_dir()
    print(f"screenshots: {folder}")
    page = Browser(driver, folder)
    try:
        yield page
    finally:
        driver.quit()
        print("screenshots saved:\n" + "\n".join(f"  {p}" for p in page.saved))


# ------------------------------------------------------------------------------------------------
# The Prefect UI: the lifecycle flow run, its task runs, its markdown artifact
# ------------------------------------------------------------------------------------------------


def _lifecycle_run(deployment: Deployment) -> dict[str, Any]:
    runs = deployment.prefect("/flow_runs/filter", {"flows": {"name": {"any_": ["tenant-lifecycle"]}}})
    assert len(runs) == 1, [r["name"] for r in runs]
    return runs[0]


def test_prefect_ui_shows_the_lifecycle_flow_run_completed_with_its_task_runs(deployment, browser):
    run = _lifecycle_run(deployment)
    assert run["state"]["type"] == "COMPLETED"
    tasks = deployment.prefect("/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
    task_names = sorted(t["name"] for t in tasks)
    assert {n.rsplit("-", 1)[0] for n in task_names} >= {"create-tenant", "train"}, task_names

    browser.open(f"{deployment.prefect_ui}/")  # where a person starts: the default UI's dashboard
    browser.wait_for_text("prefect-dashboard", "Flow Runs", "1 total", "Task Runs", "Completed")
    assert "/v2/" in browser.driver.current_url  # Prefect's default UI (V2) since 3.7

    flow_run = f"{deployment.prefect_ui}/v2/runs/flow-run/{run['id']}"
    browser.open(flow_run)
    # the header: run name, state, flow, task run count (the run graph below is drawn on a canvas)
    header = (run["name"], "Completed", "tenant-lifecycle", f"{len(task_names)} Task runs")
    browser.wait_for_text("prefect-flow-run", *header)

    browser.open(f"{flow_run}?tab=TaskRuns")
    browser.wait_for_text("prefect-flow-run-task-runs", f"({len(task_names)} Completed)", *task_names)


def test_prefect_ui_shows_the_lifecycle_markdown_artifact(deployment, browser):
    run = _lifecycle_run(deployment)
    key = f"lifecycle-{LIFECYCLE_TENANT}"
    artifacts = deployment.prefect("/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}})
    assert [a["flow_run_id"] for a in artifacts] == [run["id"]] and artifacts[0]["type"] == "markdown"

    browser.open(f"{deployment.prefect_ui}/v2/runs/flow-run/{run['id']}?tab=Artifacts")
    browser.wait_for_text("prefect-flow-run-artifacts", "MARKDOWN", key, f"tenant {LIFECYCLE_TENANT}")

    browser.open(f"{deployment.prefect_ui}/v2/artifacts/artifact/{artifacts[0]['id']}")
    # the lifecycle summary as a table: its rows, with this run's values
    page = browser.wait_for_text(
        "prefect-lifecycle-artifact",
        f"{LIFECYCLE_TENANT} (sft)", "2/2 jobs", "registered model version", "evaluation", "heldout_loss",
        "candidate", "champion", run["name"],
    )  # fmt: skip
    assert "|---|" not in page  # rendered, not shown as markdown source


# ------------------------------------------------------------------------------------------------
# The MLflow UI: each tenant's registered model, aliases and version tags; the loss curve
# ------------------------------------------------------------------------------------------------


def test_mlflow_ui_shows_the_registered_models_with_candidate_and_champion_aliases(deployment, browser):
    from joynexus.registry import CANDIDATE_ALIAS, CHAMPION_ALIAS, registered_model_name
    from recipes.main_job import DEMO_TENANTS

    client = deployment.mlflow()
    tenants = [LIFECYCLE_TENANT] + [t.tenant for t in DEMO_TENANTS]  # the flow's and the main job's
    for tenant in tenants:
        model = client.get_registered_model(registered_model_name(tenant))
        assert {CANDIDATE_ALIAS, CHAMPION_ALIAS} <= set(model.aliases), (tenant, model.aliases)

    browser.open(f"{deployment.mlflow_ui}/#/models")
    browser.wait_for_text("mlflow-registered-models", *(registered_model_name(t) for t in tenants))

    shots = {LIFECYCLE_TENANT: "mlflow-registered-model", DEMO_TENANTS[0].tenant: "mlflow-main-job-model"}
    for tenant, shot in shots.items():
        name = registered_model_name(tenant)
        browser.open(f"{deployment.mlflow_ui}/#/models/{name}")
        # the versions table: version, its tags, and the alias badges
        browser.wait_for_text(shot, name, "Version 1", "policy_version", f"@ {CANDIDATE_ALIAS}", f"@ {CHAMPION_ALIAS}")


def test_mlflow_ui_shows_the_version_tags(deployment, browser):
    from joynexus.registry import CANDIDATE_ALIAS, CHAMPION_ALIAS, registered_model_name

    name = registered_model_name(LIFECYCLE_TENANT)
    version = deployment.mlflow().get_model_version_by_alias(name, CHAMPION_ALIAS)
    browser.open(f"{deployment.mlflow_ui}/#/models/{name}/versions/{version.version}")
    browser.wait_for_text(
        "mlflow-model-version-tags",
        f"Version {version.version}", "Aliases", f"@ {CANDIDATE_ALIAS}", f"@ {CHAMPION_ALIAS}", "Tags",
        "policy_version", version.tags["policy_version"], "manifest_digest", version.tags["manifest_digest"],
        "schema_signature", version.tags["schema_signature"], "eval/heldout_loss",
    )  # fmt: skip


def test_mlflow_ui_shows_the_training_runs_loss_curve(deployment, browser):
    from selenium.webdriver.common.by import By

    from joynexus.registry import CHAMPION_ALIAS, registered_model_name

    client = deployment.mlflow()
    version = client.get_model_version_by_alias(registered_model_name(LIFECYCLE_TENANT), CHAMPION_ALIAS)
    run = client.get_run(version.run_id)
    assert len(client.get_metric_history(run.info.run_id, LOSS_METRIC)) >= 2  # a curve, not a point

    browser.open(f"{deployment.mlflow_ui}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/model-metrics")
    # the chart of train/loss: its section, title, legend (run name and metric) and a drawn line
    texts = ("Model metrics", "train", "loss", f"{run.info.run_name} ({LOSS_METRIC})")

    def drawn(driver: Any) -> list[Any]:
        if not all(text in browser.text() for text in texts):
            return []
        paths = driver.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .scatterlayer path.js-line")
        return [p for p in paths if len(p.get_attribute("d") or "") > 10]

    lines = browser.wait_for("mlflow-run-loss-curve", f"text {texts} and a drawn loss line", drawn)
    assert lines
