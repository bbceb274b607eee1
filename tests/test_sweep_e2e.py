"""End to end: real Hydra multirun, real Optuna (SQLite / PostgreSQL), real MLflow (SQLite), real tiny CPU
training in isolated worker processes. Each test works in its own folder with a private copy of conf/."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import optuna
import psutil
import pytest
import yaml
from optuna.trial import TrialState
from sweep_testing import (
    FAST_TRAIN,
    SPACE_HEADER,
    WORKER,
    children_by_trial,
    cli,
    end_orphans,
    exported_experiment,
    mlflow_runs,
    only_study,
    private_conf,
    processes_under,
    start_cli,
    tiny_space,
)

from moe_vlm_sweep.sweep import ledger

SMALL_SPACE = tiny_space(
    3,
    """params:
  batch.mbs: [1, 2, 4]
  vision: [trainable, frozen]
allow_recipe_changes: [vision]
""",
)


def _assert_consistent(study: optuna.Study, runs: list, n_trials: int) -> None:
    """Optuna and MLflow hold the same trials, all finished, each config launched once."""
    trials = study.get_trials()
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert len(ledger.counted(trials)) == n_trials
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    parents = [r for r in runs if r.data.tags.get("moe_vlm_sweep.role") == "parent"]
    assert len(parents) == 1
    children = children_by_trial(runs)
    assert set(children) == {t.number for t in trials}
    assert all(r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for r in children.values())
    launched = [
        tuple(sorted(t.params.items()))
        for t in trials
        if t.user_attrs.get("claim") == "launch" and t.number not in ledger.retried_numbers(trials)
    ]
    assert len(launched) == len(set(launched)), launched


@pytest.mark.slow
def test_cpu_demo_sweep_tracks_exports_and_reproduces(tmp_path):
    conf = private_conf(tmp_path)
    profiled = [o for o in FAST_TRAIN if not o.startswith("train.profile_steps")] + ["train.profile_steps=1"]
    out = cli(["run", "-m", "sweep=cpu_demo", "sweep.n_trials=6", *profiled], cwd=tmp_path, conf=conf).stdout
    assert "[trial 6/6]" in out and "rank  trial" in out  # a duplicate sample adds a line, not a run
    study = only_study(tmp_path)
    runs = mlflow_runs(tmp_path)
    _assert_consistent(study, runs, 6)
    expected = {"ok": "FINISHED", "duplicate": "KILLED"}
    assert all(
        r.info.status == expected.get(r.data.tags["moe_vlm_sweep.failure_class"], "FAILED")
        for r in children_by_trial(runs).values()
    ), [(r.info.run_name, r.info.status) for r in runs]
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) >= 4
    child = children_by_trial(runs)[study.best_trial.number]
    assert child.data.tags["moe_vlm_sweep.data_realism"] == "synthetic_images"
    assert child.data.tags["moe_vlm_sweep.failure_class"] == "ok" and "moe_vlm_sweep.git_commit" in child.data.tags
    assert child.data.params["model.name"] == "tiny" and "effective_tokens_per_s_per_gpu" in child.data.metrics
    assert child.info.run_name.startswith(f"trial-{study.best_trial.number} batch.mbs=")
    assert study.metric_names == ["effective_tokens_per_s_per_gpu"]
    _assert_reported(tmp_path, study, runs, child, out)

    best = cli(["best"], cwd=tmp_path, conf=conf).stdout
    assert "data realism synthetic_images" in best
    experiment = f"{study.study_name}_best"
    assert exported_experiment(tmp_path, experiment).exists()
    rerun = cli(["run", f"+experiment={experiment}"], cwd=tmp_path, conf=conf).stdout
    rerun_dir = Path(tmp_path / rerun.split("run dir: ")[1].split()[0])
    from moe_vlm_sweep.export.best import ranked

    winner = ranked(study)[0]  # the exported best: the baseline recipe's (cpu_demo also searches vision)
    trial_dir = Path(tmp_path / winner.user_attrs["run_dir"])
    assert (rerun_dir / "config.yaml").read_text() == (trial_dir / "config.yaml").read_text()


def _assert_reported(tmp_path: Path, study: optuna.Study, runs: list, child, out: str) -> None:
    """The sweep's report: its HTML embeds non-blank plots, and the parent run carries them and the best so far."""
    import matplotlib.image
    from mlflow.tracking import MlflowClient

    report = tmp_path / "outputs" / "sweeps" / study.study_name / "report"
    assert f"report: {report.relative_to(tmp_path)}/index.html" in out or f"report: {report}" in out, out[-2000:]
    page = (report / "index.html").read_text()
    for png in ("history.png", "importances.png", "outcomes.png", "components.png"):
        pixels = matplotlib.image.imread(report / png)
        assert pixels.std() > 0.05, f"{png} is blank"
    from moe_vlm_sweep.export import recipes
    from moe_vlm_sweep.sweep.trial import is_contended

    ranked = [t for t in recipes.keep(study.get_trials(states=[TrialState.COMPLETE]), recipes.chosen(study))]
    # the report ranks the baseline's recipe; a trial measured beside another process never outranks one measured
    # alone (on a loaded CI machine either may happen)
    best_of_recipe = max(ranked, key=lambda t: (not is_contended(t), t.values[0]))
    assert page.count("data:image/png;base64,") == 4 and f"#{best_of_recipe.number}" in page
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    parent = next(r for r in runs if r.data.tags.get("moe_vlm_sweep.role") == "parent")
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "report")} >= {
        "report/index.html",
        "report/history.png",
    }
    best = client.get_metric_history(parent.info.run_id, "best.effective_tokens_per_s_per_gpu")
    assert best and best[-1].value == pytest.approx(best_of_recipe.values[0])  # the baseline recipe's best
    assert "plan.json" in {a.path for a in client.list_artifacts(child.info.run_id)}
    again = cli(["report", "--out", str(tmp_path / "again")], cwd=tmp_path, conf=tmp_path / "conf").stdout
    assert "report: " in again and (tmp_path / "again" / "components.png").stat().st_size > 10_000


def test_invalid_configs_are_never_launched(tmp_path):
    """Every config of this space breaks a rule (pipelining under FSDP, mbs not dividing gbs)."""
    space = (
        SPACE_HEADER
        + """
n_trials: 4
fixed: {model: tiny, parallel: fsdp}
params:
  parallel.pp: [2, 4]
  batch.mbs: [3, 5]
"""
    )
    conf = private_conf(tmp_path, {"all_invalid": space})
    out = cli(["run", "-m", "sweep=all_invalid"], cwd=tmp_path, conf=conf).stdout
    assert out.count("-> INVALID") == 4
    assert not (tmp_path / "outputs" / "runs").exists(), "an invalid config was launched"
    study = only_study(tmp_path)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.PRUNED] * 4
    assert all("with parallel=fsdp: Megatron-FSDP does not pipeline" in t.user_attrs["reason"] for t in trials)
    runs = mlflow_runs(tmp_path)
    _assert_consistent(study, runs, 4)
    assert all("parallel.pp=" in r.data.tags["moe_vlm_sweep.reason"] for r in children_by_trial(runs).values())


@pytest.mark.slow
def test_injected_failures_are_classified_and_the_sweep_goes_on(tmp_path):
    """Real failures: vocab_size=1 crashes the data sampler, 100000 steps run past a 2 s timeout, lr=1e30 makes
    the loss NaN. Queued in the study, so each runs exactly once, then a healthy trial."""
    space = (
        SPACE_HEADER
        + """
n_trials: 4
sampler: random
objective: {metric: effective_tokens_per_s_per_gpu}
fixed: {model: tiny, train.warmup_steps: 1, train.profile_steps: 0}
allow_recipe_changes: [model.decoder.vocab_size, train.lr]
params:
  model.decoder.vocab_size: [512, 1]
  train.timeout_s: [300.0, 2.0]
  train.lr: [0.001, 1.0e+30]
  train.steps: [2, 100000]
"""
    )
    conf = private_conf(tmp_path, {"failing": space})
    storage = f"sqlite:///{tmp_path / 'failing.db'}"
    study = optuna.create_study(study_name="failing", storage=storage, direction="maximize")
    cases = {
        "crash": (1, 300.0, 0.001, 2),
        "timeout": (512, 2.0, 0.001, 100000),
        "nan": (512, 300.0, 1e30, 2),
        "ok": (512, 300.0, 0.001, 2),
    }
    for vocab, timeout_s, lr, steps in cases.values():
        study.enqueue_trial(
            {"model.decoder.vocab_size": vocab, "train.timeout_s": timeout_s, "train.lr": lr, "train.steps": steps}
        )
    out = cli(
        ["run", "-m", "sweep=failing", f"sweep.storage={storage}", "sweep.study_name=failing"], cwd=tmp_path, conf=conf
    ).stdout
    trials = optuna.load_study(study_name="failing", storage=storage).get_trials()
    assert [t.user_attrs["failure_class"] for t in trials] == list(cases), out
    assert [t.state for t in trials] == [TrialState.FAIL] * 3 + [TrialState.COMPLETE]
    children = children_by_trial(mlflow_runs(tmp_path))
    assert [children[t.number].data.tags["moe_vlm_sweep.failure_class"] for t in trials] == list(cases)
    assert [children[t.number].info.status for t in trials] == ["FAILED"] * 3 + ["FINISHED"]


@pytest.mark.slow
@pytest.mark.parametrize("stale", ["fail", "retry"])
def test_kill_9_mid_trial_then_the_same_command_resumes(tmp_path, stale):
    conf = private_conf(tmp_path, {"small": SMALL_SPACE})
    command = ["run", "-m", "sweep=small", f"sweep.resume.stale={stale}"]
    sweep = start_cli(command, cwd=tmp_path, conf=conf, log=tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            # Read the study only once the sweep has made it (its first line): a half-made SQLite store raises.
            opened = "sweep: study" in (tmp_path / "first.log").read_text()
            trials = only_study(tmp_path).get_trials() if opened else []
            if any(
                t.number >= 1 and t.user_attrs.get("claim") == "launch" and t.state == TrialState.RUNNING
                for t in trials
            ) and processes_under(tmp_path, WORKER):
                break  # inside a trial: its worker is running
            assert sweep.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.2)
        orphans = processes_under(tmp_path, WORKER)
        sweep.send_signal(signal.SIGKILL)
        sweep.wait()
        assert not psutil.wait_procs(orphans, timeout=30)[1], "the killed sweep's worker must exit on its own"
    finally:
        end_orphans(tmp_path)
    assert any(t.state == TrialState.RUNNING for t in only_study(tmp_path).get_trials())
    out = cli(command, cwd=tmp_path, conf=conf).stdout
    assert "was left RUNNING by a sweep that is gone" in out
    study = only_study(tmp_path)
    _assert_consistent(study, mlflow_runs(tmp_path), 3)
    interrupted = [k for k in study.user_attrs if k.startswith("interrupted.")]
    assert len(interrupted) == 1
    run = children_by_trial(mlflow_runs(tmp_path))[int(interrupted[0].split(".")[1])]
    assert (run.info.status, run.data.tags["moe_vlm_sweep.failure_class"]) == ("KILLED", "interrupted")
    number = int(interrupted[0].split(".")[1])
    retries = [t for t in study.get_trials() if t.user_attrs.get("retry_of") == number]
    if stale == "retry":  # re-run once, with the interrupted trial's exact parameters
        assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
        assert retries[0].params == study.trials[number].params
    else:
        assert retries == []


def _postgres_url(tmp_path: Path):
    import shutil
    import socket
    import subprocess
    import tempfile

    def unavailable(reason: str):
        # A missing server fails the test, never skips it: `make test` installs the binaries.
        pytest.fail(f"{reason}: `make test` installs PostgreSQL where it can (apt, as root)")

    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if found:
        initdb, pg_ctl = str(found[-1]), str(found[-1].with_name("pg_ctl"))
    elif shutil.which("initdb"):
        initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    else:
        unavailable("PostgreSQL (initdb/pg_ctl) is not installed on this machine")
    as_user: list[str] = []
    data = Path(tempfile.mkdtemp(prefix="pg-"))
    if os.geteuid() == 0:  # initdb refuses root: run the server as the postgres user
        if shutil.which("runuser") is None or subprocess.run(["id", "postgres"], capture_output=True).returncode:
            unavailable("running as root without a postgres user to start PostgreSQL as")
        shutil.chown(data, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run(
        [*as_user, initdb, "-D", str(data / "db"), "-U", "postgres", "--auth=trust"], check=True, capture_output=True
    )
    subprocess.run(
        [
            *as_user,
            pg_ctl,
            "-D",
            str(data / "db"),
            "-l",
            str(data / "log"),
            "-w",
            "-o",
            f"-p {port} -k {data} -c listen_addresses=127.0.0.1",
            "start",
        ],
        check=True,
        capture_output=True,
    )

    def stop():
        subprocess.run([*as_user, pg_ctl, "-D", str(data / "db"), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)

    return f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres", stop


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_workers_share_one_study_without_duplicates(tmp_path, backend):
    conf = private_conf(tmp_path, {"small": SMALL_SPACE.replace("n_trials: 3", "n_trials: 4")})
    stop = None
    if backend == "sqlite":
        storage = f"sqlite:///{tmp_path / 'shared.db'}"
    else:
        storage, stop = _postgres_url(tmp_path)
    try:
        command = ["run", "-m", "sweep=small", f"sweep.storage={storage}", "sweep.study_name=shared"]
        workers = [
            start_cli([*command, f"sweep.seed={seed}"], cwd=tmp_path, conf=conf, log=tmp_path / f"w{seed}.log")
            for seed in (1, 2)
        ]
        for worker, seed in zip(workers, (1, 2)):
            assert worker.wait(timeout=600) == 0, (tmp_path / f"w{seed}.log").read_text()[-4000:]
        study = optuna.load_study(study_name="shared", storage=storage)
        _assert_consistent(study, mlflow_runs(tmp_path), 4)
        owners = {t.user_attrs["worker"] for t in study.get_trials() if t.user_attrs.get("claim") == "launch"}
        assert len(owners) == 2, "both workers should have run trials"
    finally:
        if stop:
            stop()


def test_grid_sweep_runs_on_the_basic_sweeper(tmp_path):
    """`-m batch.mbs=3,5` without sweep=: Hydra's basic sweeper, each point through the run path (both points
    are invalid for gbs=4, so each is reported and the grid still finishes, at no training cost)."""
    conf = private_conf(tmp_path)
    proc = cli(["run", "-m", "batch.mbs=3,5"], cwd=tmp_path, conf=conf)
    assert proc.stderr.count("batch.gbs=4 must be divisible by batch.mbs") == 2
    assert len(list((tmp_path / "outputs" / "multirun").glob("*/[01]"))) == 2
    assert not (tmp_path / "outputs" / "sweeps").exists()


MIXED_REALISM_SPACE = tiny_space(4, "allow_recipe_changes: [data]\nparams:\n  data: [synthetic_images, mock_text]\n")


@pytest.mark.slow
def test_a_sweep_over_mixed_data_realism_stops_clearly(tmp_path):
    conf = private_conf(tmp_path, {"mixed": MIXED_REALISM_SPACE})
    proc = cli(["run", "-m", "sweep=mixed", "sweep.seed=1"], cwd=tmp_path, conf=conf, check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "data.realism" in text and "mock_text" in text and "synthetic_images" in text, text[-3000:]
    study = only_study(tmp_path)
    realisms = {t.user_attrs.get("data_realism") for t in study.get_trials() if t.state == TrialState.COMPLETE}
    assert len(realisms - {None}) <= 1  # nothing of a second realism was ever ranked


@pytest.mark.slow
def test_a_finished_sweep_confirms_its_top_trials_before_exporting(tmp_path):
    """sweep.confirm=N: the top trials really re-train N times each; the exported best is the one that held."""
    conf = private_conf(tmp_path, {"small": SMALL_SPACE})
    out = cli(
        ["run", "-m", "sweep=small", "sweep.confirm=1", "sweep.top_k=2", "sweep.verify_steps=3"],
        cwd=tmp_path,
        conf=conf,
    ).stdout
    study = only_study(tmp_path)
    confirmation = json.loads(
        (tmp_path / "outputs" / "sweeps" / study.study_name / "best" / "confirm.json").read_text()
    )
    assert "confirm: re-running the top 2 trial(s) 1 time(s) each" in out
    assert [len(c["repeats"]) for c in confirmation["candidates"]] == [1, 1]
    assert all(
        Path(tmp_path, r["run_dir"], "metrics.json").exists() for c in confirmation["candidates"] for r in c["repeats"]
    )
    winner = confirmation["winner"]
    assert winner is not None and f"best: trial #{winner};" in out
    experiment = exported_experiment(tmp_path, f"{study.study_name}_best").read_text()
    assert f"# Trial #{winner} of study" in experiment and "after confirmation re-runs" in experiment
    parent = next(r for r in mlflow_runs(tmp_path) if r.data.tags.get("moe_vlm_sweep.role") == "parent")
    assert parent.data.tags["moe_vlm_sweep.confirmed_trial"] == str(winner)
    # the winner trained against trial #0 on the same batches (or is trial #0); the verdict is in MLflow
    verdict = parent.data.tags["moe_vlm_sweep.verify"]
    assert verdict == ("baseline" if winner == 0 else "pass"), out[-3000:]
    assert (verdict == "baseline") or "verify: PASS" in out
    trials = {t.number: t for t in study.get_trials()}
    tagged = {
        n: r.data.tags["moe_vlm_sweep.recipe"]
        for n, r in children_by_trial(mlflow_runs(tmp_path)).items()
        if "moe_vlm_sweep.recipe" in r.data.tags
    }  # launched trials: the fingerprint of what they trained
    assert tagged and all(fingerprint == trials[n].user_attrs["recipe"] for n, fingerprint in tagged.items())


@pytest.mark.slow
def test_a_time_budget_stops_between_trials_and_the_study_resumes(tmp_path):
    """sweep.time_budget_s: no trial starts that the slowest one says would overrun it; nothing is lost.
    sweep.first_trials: the named config is trial #0, queued once however often the sweep resumes."""
    space = SMALL_SPACE + "first_trials:\n  - {batch.mbs: 4, vision: frozen}\n"
    conf = private_conf(tmp_path, {"small": space})
    cli(["run", "-m", "sweep=small", "sweep.n_trials=1"], cwd=tmp_path, conf=conf)
    assert only_study(tmp_path).get_trials()[0].params == {"batch.mbs": 4, "vision": "frozen"}  # first_trials
    out = cli(["run", "-m", "sweep=small", "sweep.time_budget_s=1"], cwd=tmp_path, conf=conf).stdout
    assert "sweep: stopping at 1/3 trials: another trial would need about" in out, out[-2000:]
    study = only_study(tmp_path)
    _assert_consistent(study, mlflow_runs(tmp_path), 1)
    cli(["run", "-m", "sweep=small", "sweep.confirm=0"], cwd=tmp_path, conf=conf)
    study = only_study(tmp_path)
    _assert_consistent(study, mlflow_runs(tmp_path), 3)
    best = tmp_path / "outputs" / "sweeps" / study.study_name / "best"
    shutil.rmtree(best)  # the confirm=0 run exported; the postponed confirmation must export again
    out = cli(["run", "-m", "sweep=small", "sweep.confirm=1", "sweep.time_budget_s=1"], cwd=tmp_path, conf=conf).stdout
    assert (
        "confirmation: postponed: re-run 1 of trial #" in out
        and "(the trial's own time)" in out
        and " (unconfirmed); re-run it" in out
    ), out
    assert (best / "overrides.yaml").exists() and not (best / "confirm.json").exists()
    assert len(only_study(tmp_path).get_trials()) == len(study.get_trials())  # no trial started
    first = [t for t in study.get_trials() if "fixed_params" in t.system_attrs and "proposed_as" not in t.user_attrs]
    assert len(first) == 1  # first_trials are queued once, not per resume (a repeat's neighbor is queued too)
    out = cli(["run", "-m", "sweep=small", "sweep.confirm=1", "sweep.verify=false"], cwd=tmp_path, conf=conf).stdout
    assert "confirm: re-running the top 3 trial(s) 1 time(s) each" in out and (best / "confirm.json").exists()
    winner = yaml.safe_load((best / "top.yaml").read_text())[0]
    assert winner["confirmed"], winner
    reruns = sorted((best.parent / "confirm" / "runs").iterdir())
    out = cli(
        ["run", "-m", "sweep=small", "sweep.confirm=1", "sweep.time_budget_s=1"], cwd=tmp_path, conf=conf
    ).stdout  # every re-run finished before: reused, however short the budget
    # the candidates are the top trials of trial #0's recipe (vision frozen): up to 3, as many as it has
    candidates = len(json.loads((best / "confirm.json").read_text())["candidates"])
    assert out.count("(finished by an earlier confirmation)") == candidates and "<- holds" in out, out[-2000:]
    assert sorted((best.parent / "confirm" / "runs").iterdir()) == reruns
    shutil.rmtree(best.parent / "confirm")
    out = cli(["run", "-m", "sweep=small", "sweep.confirm=1", "sweep.time_budget_s=1"], cwd=tmp_path, conf=conf).stdout
    assert f"best: trial #{winner['trial']} stays exported (it held in an earlier confirmation)" in out, out[-2000:]
    assert "after confirmation re-runs" in exported_experiment(tmp_path, f"{study.study_name}_best").read_text()


def test_a_space_in_the_old_list_form_of_fixed_fails_naming_the_knob(tmp_path):
    """Spaces wrote ``fixed`` as a list of override strings before it became a mapping; such a file composes and
    is refused by the spec's own check, not by a merge error that names no key."""
    space = SPACE_HEADER + "n_trials: 1\nfixed: [model=tiny]\nparams:\n  batch.mbs: [1, 2]\n"
    conf = private_conf(tmp_path, {"old": space})
    proc = cli(["run", "-m", "sweep=old"], cwd=tmp_path, conf=conf, check=False)
    assert proc.returncode != 0
    assert "sweep.fixed must map override keys to values" in proc.stderr and "['model=tiny']" in proc.stderr
    assert not (tmp_path / "outputs" / "sweeps").exists()
