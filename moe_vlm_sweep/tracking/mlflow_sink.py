"""MLflow for sweeps: one parent run per study (reused on resume), one nested child run per Optuna trial.

The child carries the flattened resolved config as params, every number of metrics.json as metrics (lists as
step series), tags a person filters on (failure class, data realism, hardware, git commit, trial number) and
the run directory's files as artifacts, so a trial can be read and replayed from the UI alone. A child is
opened before its trial launches; :meth:`SweepTracker.reconcile` closes what a killed sweep left RUNNING and
adds the children it never wrote, so after a resume MLflow holds exactly the study's trials.

This is the only module that imports mlflow (it costs seconds to import; the training worker never sees it).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from moe_vlm_sweep.config.codec import to_dict
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.status import RunStatus
from moe_vlm_sweep.metrics.schema import Metrics

TAG = "moe_vlm_sweep."
ARTIFACTS = (
    "config.yaml",
    "overrides.yaml",
    "plan.json",
    "command.sh",
    "worker.log",
    "metrics.json",
    "failure.json",
    "result.json",
    "kernels.txt",
    "copies.txt",
)
_STATUS = {
    RunStatus.OK: "FINISHED",
    RunStatus.INTERRUPTED: "KILLED",
    RunStatus.DUPLICATE: "KILLED",
    RunStatus.SURPLUS: "KILLED",
}
"""MLflow run status per failure class: KILLED for trials that never ran to the end without being at fault."""
EXPERIMENT_KIND = "mlflow.experimentKind"
"""The experiment tag MLflow's UI reads to choose its view (``custom_model_development``: training runs)."""
_BATCH = 100  # MLflow's limit on params (and tags) per log_batch call


def default_uri(outputs_dir: str | Path) -> str:
    """The default store: SQLite under the outputs folder (no server to run)."""
    return f"sqlite:///{Path(outputs_dir).resolve() / 'mlflow.db'}"


def default_artifact_root(outputs_dir: str | Path) -> str:
    return (Path(outputs_dir).resolve() / "mlartifacts").as_uri()


@contextlib.contextmanager
def sqlite_init_lock(uri: str) -> Iterator[None]:
    """Serialize the first use of a local SQLite store between processes: sweep workers started together on a
    fresh file otherwise run MLflow's schema migrations at the same time and break them."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    lock = Path(uri[len("sqlite:///") :] + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _metrics(metrics: Mapping[str, Any], now_ms: int) -> list[Metric]:
    """Numbers as metrics; lists of numbers (per-step loss and times) as step series under one key."""
    out = []
    for key, value in flatten(metrics).items():
        if key == "loss.values":
            key = "loss"
        series = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in series) or not series:
            continue
        out += [
            Metric(key, float(v) if math.isfinite(v) else float("nan"), now_ms, step) for step, v in enumerate(series)
        ]
    return out


class SweepTracker:
    def __init__(
        self, *, tracking_uri: str, experiment: str, artifact_root: str, study_name: str, static_tags: Mapping[str, str]
    ):
        self.tracking_uri, self.study_name = tracking_uri, study_name
        self.static_tags = dict(static_tags)
        with sqlite_init_lock(tracking_uri):
            self.client = MlflowClient(tracking_uri=tracking_uri)
            self.experiment_id = self._experiment(experiment, artifact_root)
            self.parent_id = self._parent()

    def _experiment(self, name: str, artifact_root: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is None:
            with contextlib.suppress(MlflowException):  # another worker may create it first
                self.client.create_experiment(name, artifact_location=artifact_root)
            found = self.client.get_experiment_by_name(name)
            assert found is not None  # created just now, by this process or another
        if EXPERIMENT_KIND not in found.tags:  # the UI then opens on runs and charts, not its GenAI view
            self.client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND, "custom_model_development")
        return found.experiment_id

    def _search(self, filter_string: str) -> list:
        runs, token = [], None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=filter_string,
                run_view_type=ViewType.ACTIVE_ONLY,
                max_results=1000,
                page_token=token,
            )
            runs += list(page)
            token = page.token
            if not token:
                return runs

    def _parents(self) -> list:
        runs = self._search(f"tags.`{TAG}study` = '{self.study_name}' and tags.`{TAG}role` = 'parent'")
        return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))

    def _parent(self) -> str:
        """The study's parent run, reused (and reopened) on resume; concurrent starters settle on the oldest."""
        parents = self._parents()
        if not parents:
            self.client.create_run(
                self.experiment_id,
                run_name=self.study_name,
                tags={**self.static_tags, f"{TAG}study": self.study_name, f"{TAG}role": "parent"},
            )
            parents = self._parents()
            for extra in parents[1:]:
                if extra.data.tags.get(f"{TAG}role") == "parent" and not self._children_of(extra.info.run_id):
                    self.client.delete_run(extra.info.run_id)
        parent = parents[0]
        if parent.info.status != "RUNNING":
            self.client.update_run(parent.info.run_id, status="RUNNING")
        return parent.info.run_id

    def _children_of(self, parent_id: str) -> list:
        return self._search(f"tags.`mlflow.parentRunId` = '{parent_id}'")

    def children(self) -> dict[int, Any]:
        """Trial number -> child run (the newest, should a crash have left two)."""
        runs = sorted(self._children_of(self.parent_id), key=lambda r: r.info.start_time)
        return {int(r.data.tags[f"{TAG}trial"]): r for r in runs if f"{TAG}trial" in r.data.tags}

    def log_sweep(self, params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        self._log(self.parent_id, params=params, tags=tags)

    def _log(
        self,
        run_id: str,
        *,
        params: Mapping[str, Any] = {},
        tags: Mapping[str, str] = {},
        metrics: Iterable[Metric] = (),
    ) -> None:
        param_list = [Param(k, str(v)[:6000]) for k, v in params.items()]
        tag_list = [RunTag(k, str(v)[:8000]) for k, v in tags.items()]
        metric_list = list(metrics)
        for i in range(0, max(len(param_list), len(tag_list), 1), _BATCH):
            self.client.log_batch(run_id, params=param_list[i : i + _BATCH], tags=tag_list[i : i + _BATCH])
        for i in range(0, len(metric_list), 1000):
            self.client.log_batch(run_id, metrics=metric_list[i : i + 1000])

    def log_sweep_files(self, folder: Path, artifact_path: str) -> None:
        """A folder's files (the report) as artifacts of the parent run."""
        self.client.log_artifacts(self.parent_id, str(folder), artifact_path)

    def log_best(self, step: int, values: Mapping[str, float]) -> None:
        """The best values so far on the parent run, one point per finished trial, so its chart view shows the
        search converging."""
        now = int(time.time() * 1000)
        self._log(self.parent_id, metrics=[Metric(f"best.{k}", float(v), now, step) for k, v in values.items()])

    def start_trial(self, number: int, *, params: Mapping[str, Any], tags: Mapping[str, str], label: str = "") -> str:
        """Open the trial's child run before it launches (so a kill leaves a trace reconcile can close). Its name
        is the trial's number and sampled knobs (``label``), what a person scans the run list for."""
        name = f"trial-{number} {label}".strip()[:250]
        run = self.client.create_run(
            self.experiment_id,
            run_name=name,
            tags={
                **self.static_tags,
                "mlflow.parentRunId": self.parent_id,
                f"{TAG}study": self.study_name,
                f"{TAG}role": "trial",
                f"{TAG}trial": str(number),
                **tags,
            },
        )
        self._log(run.info.run_id, params=flatten(params))
        return run.info.run_id

    def finish_trial(
        self,
        run_id: str,
        *,
        failure_class: RunStatus,
        tags: Mapping[str, str] = {},
        metrics: Metrics | None = None,
        run_dir: str | None = None,
    ) -> str | None:
        """Log the trial's outcome and close its run. If logging fails part way (a full disk, a lost server), the
        run is closed FAILED with the reason as a tag, never FINISHED without its metrics; returns the reason
        (None when all was logged)."""
        try:
            self._log(
                run_id,
                tags={f"{TAG}failure_class": RunStatus(failure_class), **tags},
                metrics=_metrics(to_dict(metrics) if metrics is not None else {}, int(time.time() * 1000)),
            )
            if run_dir:
                for name in ARTIFACTS:
                    path = Path(run_dir) / name
                    if path.is_file():
                        self.client.log_artifact(run_id, str(path))
        except (OSError, MlflowException) as exc:
            problem = f"{type(exc).__name__}: {exc}"[:500]
            with contextlib.suppress(OSError, MlflowException):
                self.client.set_tag(run_id, f"{TAG}tracking_error", problem)
            self.client.set_terminated(run_id, status="FAILED")
            return problem
        self.client.set_terminated(run_id, status=_STATUS.get(RunStatus(failure_class), "FAILED"))
        return None

    def reconcile(self, trials: Iterable[Any], describe) -> int:
        """Make every finished trial's child exist and be closed; ``describe(trial)`` gives its failure class,
        params and tags. A successful trial's metrics are logged from its run directory's ``result.json``; one
        whose metrics cannot be found is closed FAILED (tagged ``tracking_error``), not FINISHED without them.
        Returns how many runs were closed or added."""
        children, fixed = self.children(), 0
        for trial in trials:
            failure_class, params, tags = describe(trial)
            run = children.get(trial.number)
            if run is None:
                run_id = self.start_trial(trial.number, params=params, tags=tags)
            elif run.info.status == "RUNNING":
                run_id = run.info.run_id
            else:
                continue
            run_dir = trial.user_attrs.get("run_dir")
            metrics = _result_metrics(run_dir)
            if failure_class == RunStatus.OK and metrics is None:
                self.client.set_tag(
                    run_id, f"{TAG}tracking_error", f"the trial's metrics were not found in {run_dir}/result.json"
                )
                self.finish_trial(
                    run_id, failure_class=RunStatus.CRASH, tags={**tags, f"{TAG}failure_class": RunStatus.OK}
                )
            else:
                self.finish_trial(run_id, failure_class=failure_class, tags=tags, metrics=metrics, run_dir=run_dir)
            fixed += 1
        return fixed

    def close_sweep(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.parent_id, status=status)


def _result_metrics(run_dir: str | None) -> Metrics | None:
    """The metrics of a run's ``result.json`` (None without one, or one that does not read)."""
    try:
        return RunResult.read(Path(run_dir)).metrics if run_dir else None
    except (OSError, ValueError):
        return None


def log_report(*, tracking_uri: str, experiment: str, study_name: str, folder: Path) -> str | None:
    """Log a report's files as artifacts ``report/`` of the study's parent run; its id, or None without one."""
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs(
        [found.experiment_id],
        max_results=1,
        run_view_type=ViewType.ACTIVE_ONLY,
        filter_string=f"tags.`{TAG}study` = '{study_name}' and tags.`{TAG}role` = 'parent'",
        order_by=["attributes.start_time ASC"],
    )
    if not runs:
        return None
    client.log_artifacts(runs[0].info.run_id, str(folder), "report")
    return runs[0].info.run_id


def recorded_trials(*, tracking_uri: str, experiment: str, study_name: str) -> int:
    """How many trial runs MLflow holds for ``study_name`` (0 when there is no such experiment or study); asked
    before a study is created, so an emptied Optuna database is noticed instead of started over."""
    with sqlite_init_lock(tracking_uri):
        client = MlflowClient(tracking_uri=tracking_uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return 0
        runs = client.search_runs(
            [found.experiment_id],
            max_results=1000,
            run_view_type=ViewType.ACTIVE_ONLY,
            filter_string=f"tags.`{TAG}study` = '{study_name}' and tags.`{TAG}role` = 'trial'",
        )
    return len(runs)


def export_study_runs(*, tracking_uri: str, experiment: str, study_name: str) -> list[dict[str, Any]]:
    """The study's parent and child runs as plain data (info, params, metrics' last values, tags), parent first
    then children by trial number: what a reader of committed results needs without the MLflow store."""
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise KeyError(f"no MLflow experiment {experiment!r} in {tracking_uri}")
    runs = client.search_runs(
        [found.experiment_id],
        filter_string=f"tags.`{TAG}study` = '{study_name}'",
        run_view_type=ViewType.ACTIVE_ONLY,
        max_results=10000,
    )

    def order(run) -> tuple:
        tags = run.data.tags
        return (tags.get(f"{TAG}role") != "parent", int(tags.get(f"{TAG}trial", -1)), run.info.start_time)

    return [
        {
            "run_id": r.info.run_id,
            "run_name": r.info.run_name,
            "status": r.info.status,
            "start_time": r.info.start_time,
            "end_time": r.info.end_time,
            "params": dict(r.data.params),
            "metrics": dict(r.data.metrics),
            "tags": {k: v for k, v in r.data.tags.items() if not k.startswith("mlflow.source")},
        }
        for r in sorted(runs, key=order)
    ]
