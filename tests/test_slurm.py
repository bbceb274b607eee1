"""Slurm through submitit, on a real one-node cluster (``tests/slurm_cluster.py``, the ``slurm`` fixture): the
preset composes; a job that cannot hold the runs is refused before submission; a sweep's trials run as sbatch
jobs, and the sweep resumes after kill -9; a cancelled job is a crash and the sweep goes on; a job Slurm ends at
its time limit is a timeout and the sweep goes on; sweep workers run as a job array on one PostgreSQL study, and a
worker requeued (scontrol requeue) or preempted by a higher-priority partition's job resumes it. Under CI=true (or
MOE_VLM_SWEEP_REQUIRE_SLURM=1) a cluster that cannot start fails these tests; elsewhere they skip."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
import sweep_testing
from hydra import compose, initialize_config_dir
from optuna.trial import TrialState
from sweep_testing import children_by_trial, cli, end_orphans, mlflow_runs, only_study, private_conf

from moe_vlm_sweep.config.compose import CONF_DIR, register
from moe_vlm_sweep.launch.slurm import is_submitit, job_problems
from moe_vlm_sweep.sweep import ledger

ROOT = Path(__file__).resolve().parents[1]

JOB = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 8, "timeout_min": 60, "signal_delay_s": 120}


def test_the_slurm_preset_composes_on_hydras_submitit_launcher():
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="t"):
        cfg = compose(
            config_name="config",
            overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
            return_hydra_config=True,
        )
    job = cfg.hydra.launcher
    assert is_submitit(job) and job._target_.endswith("SlurmLauncher")
    assert (job.nodes, job.tasks_per_node, job.gpus_per_node, job.partition) == (1, 1, 8, "gpu")
    assert job_problems(job, nproc_per_node=8, nnodes=1, timeout_s=600) == []
    assert job_problems(job, nproc_per_node=8, nnodes=1, timeout_s=3600 - 240) == []
    assert job_problems(job, nproc_per_node=8, nnodes=1, timeout_s=3600 - 239) != []


@pytest.mark.parametrize(
    "change, launcher, message",
    [
        ({"tasks_per_node": 8}, {}, "hydra.launcher.tasks_per_node=8 must be 1: the job's one task starts the worker"),
        ({"gpus_per_node": 4}, {}, "hydra.launcher.gpus_per_node=4 is less than launcher.nproc_per_node=8"),
        ({"nodes": 2}, {}, "hydra.launcher.nodes=2 must be 1"),
        ({}, {"nnodes": 2}, "launcher.nnodes=2: a run under Slurm is one node's process group"),
        (
            {"timeout_min": 10},
            {},
            "hydra.launcher.timeout_min=10 must exceed train.timeout_s=600 s by at least 120 s "
            "+ hydra.launcher.signal_delay_s=120",
        ),
        ({"timeout_min": 13}, {}, "hydra.launcher.timeout_min=13 must exceed train.timeout_s=600 s by at least 120 s "),
        (
            {"timeout_min": 11, "signal_delay_s": 0},
            {},
            "hydra.launcher.timeout_min=11 must exceed train.timeout_s=600 s",
        ),
    ],
)
def test_a_job_that_cannot_hold_the_run_is_named(change, launcher, message):
    problems = job_problems({**JOB, **change}, **{"nproc_per_node": 8, "nnodes": 1, **launcher}, timeout_s=600)
    assert len(problems) == 1 and message in problems[0], problems


def _scancel(job_id: int) -> None:
    """What scancel does to a local job: SIGKILL to its controller (the job id is its pid) and every process under
    it, the trial's worker included."""
    job = psutil.Process(job_id)
    for process in [*job.children(recursive=True), job]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


SPACE = sweep_testing.tiny_space(2, "params:\n  batch.mbs: [1, 2, 4]\n")


SLURM_CPU = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null"]
"""The GPU preset on the test cluster's CPU node: no GPU to ask for (one CPU per job, the preset's one task)."""


@pytest.fixture
def cluster(slurm, monkeypatch):
    """The test run's Slurm cluster with its node idle (no job of an earlier test still holds a CPU), and
    ``SLURM_CONF`` set for the processes the test starts (sbatch, squeue, submitit read it)."""
    slurm.wait_idle(timeout=300)
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    return slurm


def _jobs(cluster, folder: Path) -> dict[str, str]:
    """Slurm job id -> state (sacct's), for the jobs submitit submitted under ``folder``."""
    ids = sorted({p.name.split("_")[0] for p in folder.glob("**/*_submitted.pkl")})
    return {i: cluster.job_state(i) for i in ids}


def _start_sweep(args: list[str], *, cwd: Path, conf: Path, log: Path) -> subprocess.Popen:
    """The sweep in a process group of its own, so the test can kill it as a shell's Ctrl-\\ or kill -9 -PGID
    would, without killing pytest."""
    return subprocess.Popen(
        [sys.executable, "-m", "moe_vlm_sweep.cli", *args],
        cwd=cwd,
        env={**os.environ, "MOE_VLM_SWEEP_CONF": str(conf), "PYTHONUNBUFFERED": "1"},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait(predicate, what: str, proc: subprocess.Popen | None, log: Path, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert proc is None or proc.poll() is None, f"exited {proc.returncode} waiting for {what}\n" + log.read_text()
        assert time.monotonic() < deadline, f"no {what} after {timeout} s\n" + log.read_text()[-4000:]
        time.sleep(0.5)
    return value


def _study_db(cwd: Path) -> Path | None:
    dbs = list((cwd / "outputs" / "sweeps").glob("*/optuna.db"))
    return dbs[0] if dbs else None


def _trials(cwd: Path) -> list:
    db = _study_db(cwd)
    if db is None:
        return []
    try:
        return only_study(cwd).get_trials()
    except Exception:
        return []


@pytest.mark.slow
def test_a_sweeps_trials_run_as_slurm_jobs_and_a_killed_sweep_resumes(cluster, tmp_path):
    """Each trial is an sbatch job whose result the sweep reads. kill -9 of the sweep's process group while a
    trial's job runs: the same command resumes the study; the trial it was waiting for is marked interrupted and
    re-run once (sweep.resume.stale=retry); no trial is lost or run twice as a counted one. Each trial trains 40
    steps, so the job the killed sweep waited for is still running when the same command resumes."""
    space = SPACE.replace("train.steps: 2", "train.steps: 40")
    conf, log = private_conf(tmp_path, {"tiny2": space}), tmp_path / "sweep.log"
    command = ["run", "-m", "sweep=tiny2", *SLURM_CPU, "sweep.resume.stale=retry"]
    proc = _start_sweep(command, cwd=tmp_path, conf=conf, log=log)

    def submitit_dirs() -> list[Path]:
        return list((tmp_path / "outputs" / "multirun").glob("*/.submitit"))

    try:
        _wait(lambda: any(t.state == TrialState.COMPLETE for t in _trials(tmp_path)), "a finished trial", proc, log)

        # the first job done (Slurm may show it RUNNING for a moment after its result is read) and the second running
        def states() -> list[str]:
            return sorted(s for d in submitit_dirs() for s in _jobs(cluster, d).values())

        _wait(
            lambda: states() == ["COMPLETED", "RUNNING"],
            "the first trial's job completed and the second's running",
            proc,
            log,
        )
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    first_run = {k: v for d in submitit_dirs() for k, v in _jobs(cluster, d).items()}
    assert sorted(first_run.values()) == ["COMPLETED", "RUNNING"], first_run
    out = cli(command, cwd=tmp_path, conf=conf, timeout=600).stdout
    assert "was left RUNNING by a sweep that is gone; marked failed (interrupted), re-queued once" in out, out
    study = only_study(tmp_path)
    trials = study.get_trials()
    counted = ledger.counted(trials)
    assert len(counted) == 2 and all(t.user_attrs["failure_class"] == "ok" for t in counted), [
        (t.number, t.state, t.user_attrs.get("failure_class")) for t in trials
    ]
    assert len({tuple(sorted(t.params.items())) for t in counted}) == 2, "no config measured twice"
    interrupted = [t for t in trials if f"interrupted.{t.number}" in study.user_attrs]
    assert len(interrupted) == 1
    _assert_rerun_once(trials, interrupted[0].number)
    cluster.wait_idle(timeout=300)  # the job the killed sweep waited for ran on to its end, unread
    jobs = {k: v for d in submitit_dirs() for k, v in _jobs(cluster, d).items()}
    assert list(jobs.values()) == ["COMPLETED"] * 3, jobs  # each counted trial's, and the one left running
    children = children_by_trial(mlflow_runs(tmp_path))
    assert children[interrupted[0].number].data.tags["moe_vlm_sweep.failure_class"] == "interrupted"
    assert all(children[t.number].info.status == "FINISHED" for t in counted)


@pytest.mark.slow
def test_sweep_workers_run_as_a_slurm_array_on_one_postgresql_study_and_a_requeued_one_resumes(cluster, tmp_path):
    """launchers/sweep_workers.py on Slurm: two array tasks, one PostgreSQL study, no config twice, n_trials
    honoured. One task is requeued (scontrol requeue) while its sweep runs a trial: Slurm kills it and runs the
    same command again, and that sweep resumes the study (the trial it was running is marked interrupted)."""
    from test_sweep_e2e import _postgres_url

    space = (
        SPACE.replace("n_trials: 2", "n_trials: 4")  # 6 configs
        + "  vision: [trainable, frozen]\nallow_recipe_changes: [vision]\n"
    )
    conf, quiet = private_conf(tmp_path, {"tiny4": space}), Path(os.devnull)
    storage, stop = _postgres_url(tmp_path)
    proc = _start_workers(
        tmp_path,
        conf,
        storage,
        *("--cluster", "slurm", "--seed", "7", "--slurm", "timeout_min=30", "--folder", str(tmp_path / "submitit")),
        *("--", "sweep=tiny4", "sweep.study_name=shared"),
    )
    try:
        lines = _submitted(proc, 2)

        def study():
            return optuna.load_study(study_name="shared", storage=storage)

        def running_trial_task():
            """(array task, trial number) of a trial a worker runs, from its sweep process's Slurm environment."""
            try:
                trials = study().get_trials()
            except KeyError:  # not created yet
                return None
            for t in trials:
                if t.state == TrialState.RUNNING and t.user_attrs.get("claim") == "launch":
                    env = psutil.Process(int(t.user_attrs["worker"].split(":")[1])).environ()
                    return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}", t.number
            return None

        requeued, interrupted = _wait(running_trial_task, "a trial a worker runs", None, quiet)
        cluster.run("scontrol", "requeue", requeued)
        out = "".join(lines) + proc.communicate(timeout=900)[0]
        assert proc.returncode == 0, out[-6000:]
        trials, attrs = study().get_trials(), study().user_attrs
    finally:
        if proc.poll() is None:
            proc.kill()
        stop()
    assert out.count(": exit 0") == 2 and "sweep.seed=7" in out and "sweep.seed=8" in out, out[-3000:]
    assert "REQUEUED" in cluster.run("sacct", "-n", "-D", "-P", "-o", "State", "-j", requeued)
    log = (tmp_path / "submitit" / f"{requeued}_0_log.out").read_text()
    assert log.count("Starting with JobEnvironment") == 2 and log.count("sweep: study shared") == 2, log[-3000:]
    logs = "".join(p.read_text() for p in sorted((tmp_path / "submitit").glob("*_log.*")))  # whichever worker saw it
    # Slurm's SIGTERM stops the sweep cleanly (it marks the trial itself), or kills it first (the resume marks it)
    stopped = f"trial #{interrupted} marked interrupted and queued to run again"
    gone = f"resume: trial #{interrupted} was left RUNNING by a sweep that is gone"
    assert stopped in logs or gone in logs, logs[-3000:]
    assert trials[interrupted].state == TrialState.FAIL
    assert (
        f"interrupted.{interrupted}" in attrs  # marked on resume
        or trials[interrupted].user_attrs.get("failure_class") == "interrupted"
    )  # marked by the clean stop
    # the interrupted trial is re-run once (sweep.resume.stale=retry, the default); every other config runs once
    _assert_rerun_once(trials, interrupted)
    launched = [t for t in trials if t.user_attrs.get("claim") == "launch" and t.number != interrupted]
    assert len(ledger.counted(trials)) == 4, [(t.number, t.state, t.user_attrs.get("failure_class")) for t in trials]
    assert len({tuple(sorted(t.params.items())) for t in launched}) == len(launched), "no config twice"
    # Both array tasks worked on the study: the requeued one ran the interrupted trial (its sweep's environment
    # said so), and the other one's log shows a trial it took up, waiting for the host's CPU lock (one trial
    # measures at a time), launched (Hydra's line) or training.
    task_logs = {p.name.rsplit("_", 2)[0]: p.read_text() for p in (tmp_path / "submitit").glob("*_log.out")}
    (other,) = set(task_logs) - {requeued}
    taken = re.findall(r"\[trial #(\d+)\] waiting|\[HYDRA\] \t#(\d+) : |trial #(\d+) \[step", task_logs[other])
    assert len(task_logs) == 2 and taken, {task: text[-1500:] for task, text in task_logs.items()}


@pytest.mark.slow
def test_a_sweep_worker_preempted_by_a_higher_priority_job_resumes_the_study(cluster, tmp_path):
    """Slurm's preemption: a sweep worker (a job of the default partition) runs a trial when a job of the urgent
    partition (a higher PriorityTier) asks for every CPU of the node. Slurm preempts the worker (SIGTERM, SIGKILL
    after KillWait) and requeues it (PreemptMode=REQUEUE), runs the urgent job, then the worker again: the same
    command, which resumes the study. The trial it was running is marked interrupted and re-run once, the trials
    it finished stay, no config is measured twice, n_trials holds, and MLflow has each trial's run."""
    from test_sweep_e2e import _postgres_url

    conf, quiet = private_conf(tmp_path, {"tiny2": SPACE}), Path(os.devnull)
    storage, stop = _postgres_url(tmp_path)
    args = ["--workers", "1", "--cluster", "slurm", "--slurm", "timeout_min=30", "--folder", str(tmp_path / "s")]
    # the last --workers holds
    proc = _start_workers(tmp_path, conf, storage, *args, "--", "sweep=tiny2", "sweep.study_name=shared")
    try:
        (line,) = _submitted(proc, 1)
        worker = line.split()[1].rstrip(":")

        def running_trial():
            try:
                trials = optuna.load_study(study_name="shared", storage=storage).get_trials()
            except KeyError:  # not created yet
                return None
            # one that owns its config: a signal before that (while the trial's config composes) is not a run's
            return next(
                (t.number for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get("claim") == "launch"),
                None,
            )

        # generous: a trial waits for the CPU cores another trial on this host measures on
        interrupted = _wait(running_trial, "a trial the worker runs", None, quiet, timeout=600)
        urgent = cluster.run(
            "sbatch",
            "--parsable",
            "-p",
            "urgent",
            f"--cpus-per-task={cluster.cpus}",
            "-o",
            os.devnull,
            "--wrap",
            "sleep 1",
        ).strip()
        out = line + proc.communicate(timeout=900)[0]
        assert proc.returncode == 0, out[-6000:]
        study = optuna.load_study(study_name="shared", storage=storage)
        trials, attrs = study.get_trials(), study.user_attrs
    finally:
        if proc.poll() is None:
            proc.kill()
        stop()
    history = cluster.run("sacct", "-n", "-D", "-X", "-P", "-o", "JobID,State,Partition", "-j", f"{worker},{urgent}")
    assert "PREEMPTED" in history and f"{urgent}|COMPLETED|urgent" in history, history
    log = (tmp_path / "s" / f"{worker}_0_log.out").read_text()
    assert log.count("Starting with JobEnvironment") == 2 and log.count("sweep: study shared") == 2, log[-3000:]
    assert trials[interrupted].state == TrialState.FAIL
    assert (
        f"interrupted.{interrupted}" in attrs or trials[interrupted].user_attrs.get("failure_class") == "interrupted"
    ), (attrs, trials[interrupted].user_attrs)
    _assert_rerun_once(trials, interrupted)
    _assert_rerun_once(trials, interrupted)
    counted = ledger.counted(trials)
    assert len(counted) == 2 and all(t.user_attrs["failure_class"] == "ok" for t in counted), [
        (t.number, t.state, t.user_attrs.get("failure_class")) for t in trials
    ]
    launched = [t for t in trials if t.user_attrs.get("claim") == "launch" and t.number != interrupted]
    assert len({tuple(sorted(t.params.items())) for t in launched}) == len(launched), "no config twice"
    children = children_by_trial(mlflow_runs(tmp_path))
    assert children[interrupted].data.tags["moe_vlm_sweep.failure_class"] == "interrupted"
    assert all(children[t.number].info.status == "FINISHED" for t in counted)


def _assert_rerun_once(trials: list, interrupted: int) -> None:
    """One trial re-ran the interrupted one's config to the end (``retry_of``), and no other did."""
    retries = [t for t in trials if int(t.user_attrs.get("retry_of", -1)) == interrupted]
    assert [(t.state, t.params) for t in retries] == [(TrialState.COMPLETE, trials[interrupted].params)], [
        (t.number, t.state, t.user_attrs) for t in trials
    ]


def _sweep_workers(storage: str, *args: str) -> list[str]:
    cluster = [] if "--cluster" in args else ["--cluster", "local"]
    return [
        sys.executable,
        str(ROOT / "launchers" / "sweep_workers.py"),
        "--workers",
        "2",
        "--storage",
        storage,
        *cluster,
        "--wait",
        *args,
    ]


def _sweep_workers_module():
    spec = importlib.util.spec_from_file_location("sweep_workers", ROOT / "launchers" / "sweep_workers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env(conf: Path) -> dict:
    return {**os.environ, "MOE_VLM_SWEEP_CONF": str(conf), "PYTHONUNBUFFERED": "1"}


def _start_workers(tmp_path: Path, conf: Path, storage: str, *args: str) -> subprocess.Popen:
    """``launchers/sweep_workers.py`` on ``storage`` in the background, its console (stderr too) on a pipe."""
    return subprocess.Popen(
        _sweep_workers(storage, *args),
        cwd=tmp_path,
        env=_env(conf),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _submitted(proc: subprocess.Popen, count: int) -> list[str]:
    """The first ``count`` console lines, each a submitted worker's (``worker JOB_ID: ...``)."""
    lines = [proc.stdout.readline() for _ in range(count)]
    assert all(line.startswith("worker ") for line in lines), lines
    return lines


@pytest.mark.slow
def test_a_lost_worker_job_does_not_hide_the_other_workers_status(tmp_path):
    conf = private_conf(tmp_path, {"tiny4": SPACE.replace("n_trials: 2", "n_trials: 3")})
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    proc = _start_workers(
        tmp_path, conf, storage, "--folder", str(tmp_path / "submitit"), "--", "sweep=tiny4", "sweep.study_name=shared"
    )
    try:
        lines = _submitted(proc, 2)
        job_ids = [line.split()[1].rstrip(":") for line in lines]
        _scancel(int(job_ids[0]))
        out = "".join(lines) + proc.communicate(timeout=900)[0]
    finally:
        end_orphans(tmp_path)
    assert proc.returncode == 1, out
    assert f"worker {job_ids[0]}: failed: UncompletedJobError" in out and f"worker {job_ids[1]}: exit 0" in out, out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--slurm", "timeout_min=4"], "--slurm timeout_min=4: a sweep job needs more than 300 s"),
        (
            ["--slurm", "timeout_min=30", "--", "sweep=cpu_demo", "sweep.time_budget_s=2000"],
            "sweep.time_budget_s=2000 does not fit the job: timeout_min=30 leaves at most 1500 s",
        ),
        (
            ["--slurm", "timeout_min=30", "--", "sweep=cpu_demo", "++sweep.time_budget_s=2000"],
            "sweep.time_budget_s=2000 does not fit the job",
        ),
        (["--slurm", "timeout_min=90.5"], "--slurm timeout_min=90.5: expected whole minutes"),
        (["--slurm", "timeout_min=30", "--", "sweep=cpu_demo", "batch.mbz=2"], "the sweep's overrides do not compose"),
    ],
)
def test_sweep_workers_keep_the_sweeps_budget_inside_the_job(args, message, tmp_path):
    args = args if "--" in args else [*args, "--", "sweep=cpu_demo"]
    proc = subprocess.run(
        _sweep_workers(f"sqlite:///{tmp_path / 'x.db'}", "--folder", str(tmp_path / "s"), *args),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "s").exists(), "nothing may be submitted"


@pytest.mark.parametrize(
    "space_budget, expected", [(600, None), (5000, "sweep.time_budget_s=1500"), (None, "sweep.time_budget_s=1500")]
)
def test_sweep_workers_keep_a_smaller_budget_from_the_space_file(space_budget, expected, tmp_path):
    """A budget in the space's file stands when it fits the job, and is capped at the job's limit when not."""
    space = SPACE + (f"time_budget_s: {space_budget}\n" if space_budget else "")
    conf = private_conf(tmp_path, {"budgeted": space})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("moe_vlm_sweep.config.compose.CONF_DIR", conf)
        added = _sweep_workers_module().time_budget(["sweep=budgeted"], timeout_min=30)
    assert added == ([expected] if expected else [])


def test_sweep_workers_refuse_sqlite_on_slurm():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launchers" / "sweep_workers.py"),
            "--workers",
            "2",
            "--storage",
            "sqlite:///x.db",
            "--",
            "sweep=cpu_demo",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "workers on several nodes need PostgreSQL storage" in proc.stderr


@pytest.mark.parametrize(
    "state, failure_class, optuna_state",
    [
        ("TIMEOUT", "timeout", "fail"),
        ("OUT_OF_MEMORY", "oom", "pruned"),
        ("NODE_FAIL", "crash", "fail"),
        ("CANCELLED by 1234", "crash", "fail"),
    ],
)
def test_a_lost_job_is_classified_by_the_slurm_state_submitit_reports(state, failure_class, optuna_state):
    from submitit.core.utils import UncompletedJobError

    from moe_vlm_sweep.sweep.trial import is_rejected_submission, outcome_of_lost_job

    exc = UncompletedJobError(
        f"Job 42 (task: 0) with path /x/42_0_result.pkl\nhas not produced any output "
        f"(state: {state})\nError stream produced:\nslurmstepd: error: ..."
    )
    outcome = outcome_of_lost_job(exc)
    assert (outcome.failure_class, outcome.state) == (failure_class, optuna_state)
    assert not is_rejected_submission(exc)
    assert outcome.reason.startswith("the launcher lost the job: UncompletedJobError: Job 42")
    assert f"(state: {state})" in outcome.reason


def test_a_long_error_stream_keeps_the_state_and_a_refused_submission_is_told_apart():
    from submitit.core.utils import FailedSubmissionError, UncompletedJobError

    from moe_vlm_sweep.sweep.trial import is_rejected_submission, outcome_of_lost_job

    exc = UncompletedJobError(
        "Job 7 (task: 0) with path /x\nhas not produced any output (state: TIMEOUT)\n"
        "Error stream produced:\n" + "noise\n" * 5000 + "slurmstepd: CANCELLED DUE TO TIME LIMIT"
    )
    outcome = outcome_of_lost_job(exc)
    assert outcome.failure_class == "timeout" and len(outcome.reason) < 2000
    assert "(state: TIMEOUT)" in outcome.reason and outcome.reason.endswith("CANCELLED DUE TO TIME LIMIT")
    assert is_rejected_submission(FailedSubmissionError("sbatch: error: QOSMaxSubmitJobPerUserLimit"))


@pytest.mark.parametrize("why", ["timed-out too many times", "timed-out and not checkpointable"])
def test_a_job_submitit_ended_at_the_time_limit_is_a_timeout(why):
    """At Slurm's time-limit signal submitit's job requeues itself or raises; raised, it reaches the sweep as the
    job's result, with no Slurm state in its header."""
    from submitit.core.utils import UncompletedJobError

    from moe_vlm_sweep.sweep.trial import outcome_of_lost_job

    outcome = outcome_of_lost_job(UncompletedJobError(f"Job not requeued because: {why}."))
    assert (outcome.failure_class, outcome.state) == ("timeout", "fail")


LONG = ["train.steps=100000", "train.timeout_s=3000", "batch.gbs=64"]
"""Trials that run until something ends them, in steps of 16-64 micro-batches: a minute of them is tens of
optimizer steps, not hundreds. The tiny CPU worker has aborted on a corrupted heap (glibc's "malloc(): unaligned
tcache chunk detected") twice in about 30 such one-minute trials under this cluster, after 205 and 604 steps, and
a trial that crashes before Slurm's limit is not the case under test."""


def _what_the_jobs_did(cwd: Path, jobs: list[str], trials: list, log: Path) -> str:
    """For a failed assertion on the jobs' states: each trial's outcome, each job's own log and the sweep's."""
    lines = [
        f"trial #{t.number}: {t.state.name} {t.user_attrs.get('failure_class')}: {t.user_attrs.get('reason')}"
        for t in trials
    ]
    for job in jobs:
        for path in sorted((cwd / "outputs" / "multirun").glob(f"*/.submitit/{job}/{job}_0_log.*")):
            lines += [f"--- {path.name}", path.read_text()[-3000:]]
    return "\n".join([*lines, "--- sweep log", log.read_text()[-3000:]])


def _running_job(cluster, cwd: Path, proc, log: Path, seen: set) -> str:
    """The id of a trial's job the sweep submitted that is RUNNING and not in ``seen``."""

    def find():
        for folder in (cwd / "outputs" / "multirun").glob("*/.submitit"):
            for job, state in _jobs(cluster, folder).items():
                if state == "RUNNING" and job not in seen:
                    return job
        return None

    return _wait(find, "a running trial job", proc, log)


@pytest.mark.slow
def test_a_cancelled_job_is_a_crash_and_a_run_past_its_timeout_a_timeout(cluster, tmp_path):
    """scancel of a running trial's job: Slurm ends it CANCELLED, the trial fails as a crash and the next trial
    runs. A run past train.timeout_s inside its job: the worker is killed and the trial is a timeout (the shape
    check keeps the job's limit beyond it, so Slurm's kill never comes first). Both in Optuna and MLflow."""
    conf, log = private_conf(tmp_path, {"tiny2": SPACE}), tmp_path / "sweep.log"
    proc = _start_sweep(
        ["run", "-m", "sweep=tiny2", *SLURM_CPU, "train.steps=100000", "train.timeout_s=40"],
        cwd=tmp_path,
        conf=conf,
        log=log,
    )
    try:
        first = _running_job(cluster, tmp_path, proc, log, set())
        cluster.run("scancel", first)
        second = _running_job(cluster, tmp_path, proc, log, {first})
        assert proc.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (cluster.job_state(first), cluster.job_state(second)) == ("CANCELLED", "COMPLETED")
    trials = only_study(tmp_path).get_trials()
    assert [t.user_attrs["failure_class"] for t in trials] == ["crash", "timeout"], log.read_text()[-3000:]
    assert "(state: CANCELLED" in trials[0].user_attrs["reason"], trials[0].user_attrs["reason"]
    assert "no result within train.timeout_s=40 s" in trials[1].user_attrs["reason"]
    children = children_by_trial(mlflow_runs(tmp_path))
    assert [
        (children[t.number].info.status, children[t.number].data.tags["moe_vlm_sweep.failure_class"]) for t in trials
    ] == [("FAILED", "crash"), ("FAILED", "timeout")]


@pytest.mark.slow
def test_a_job_slurm_ends_at_its_time_limit_is_a_timeout_and_the_sweep_goes_on(cluster, tmp_path):
    """Slurm's own time limit: each trial's job is submitted with a limit that holds its run (60 min, past
    train.timeout_s=3000 s by the margin), and once it runs its limit is cut to one minute, Slurm's least, as a
    user or an admin may (``scontrol update TimeLimit=1``). Slurm ends the job at that limit (SIGTERM, SIGKILL
    after KillWait) and records it TIMEOUT; the trial fails as a timeout and the sweep goes on to the next trial,
    which ends the same way. signal_delay_s=0: no submitit signal before the limit, so the kill is Slurm's."""
    conf, log = private_conf(tmp_path, {"tiny2": SPACE}), tmp_path / "sweep.log"
    proc = _start_sweep(
        ["run", "-m", "sweep=tiny2", *SLURM_CPU, "hydra.launcher.signal_delay_s=0", *LONG],
        cwd=tmp_path,
        conf=conf,
        log=log,
    )
    jobs: list[str] = []
    try:
        for _ in range(2):
            jobs.append(_running_job(cluster, tmp_path, proc, log, set(jobs)))
            assert "TimeLimit=01:00:00" in cluster.run("scontrol", "show", "job", jobs[-1])
            cluster.run("scontrol", "update", f"JobId={jobs[-1]}", "TimeLimit=1")
        assert proc.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    trials = only_study(tmp_path).get_trials()
    states = [cluster.job_state(j) for j in jobs]
    assert states == ["TIMEOUT", "TIMEOUT"], _what_the_jobs_did(tmp_path, jobs, trials, log)
    assert [t.user_attrs["failure_class"] for t in trials] == ["timeout", "timeout"], log.read_text()[-3000:]
    assert all("(state: TIMEOUT" in t.user_attrs["reason"] for t in trials), [t.user_attrs["reason"] for t in trials]
    children = children_by_trial(mlflow_runs(tmp_path))
    assert [
        (children[t.number].info.status, children[t.number].data.tags["moe_vlm_sweep.failure_class"]) for t in trials
    ] == [("FAILED", "timeout"), ("FAILED", "timeout")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["hydra.launcher.tasks_per_node=2"], "hydra.launcher.tasks_per_node=2 must be 1"),
        (
            ["launcher=torchrun", "launcher.nnodes=2"],
            "launcher.nnodes=2: a run under Slurm is one node's process group",
        ),
        (["hydra.launcher.timeout_min=5"], "hydra.launcher.timeout_min=5 must exceed train.timeout_s=600 s"),
    ],
)
def test_a_job_that_cannot_hold_the_runs_is_refused_before_submission(cluster, tmp_path, overrides, message):
    """Exit 2 with the knob and the rule, no traceback, and nothing reaches the scheduler or the outputs."""
    conf = private_conf(tmp_path, {"tiny2": SPACE})
    before = cluster.run("sacct", "-n", "-X", "-a", "-P", "-o", "JobID")
    proc = cli(["run", "-m", "sweep=tiny2", *SLURM_CPU, *overrides], cwd=tmp_path, conf=conf, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error: the Slurm job (hydra.launcher) cannot hold this sweep's runs: " in proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "outputs").exists(), "nothing may be created before the job is known to fit"
    assert cluster.run("sacct", "-n", "-X", "-a", "-P", "-o", "JobID") == before, "no job submitted"


def test_a_preempted_sweep_worker_stops_its_sweep_and_resubmits_the_same_command(tmp_path):
    """SweepWorker.checkpoint (what submitit calls on preemption or near the time limit, before it requeues the
    task): the running sweep process is stopped, and the task requeued is the same command."""
    workers = _sweep_workers_module()
    task = workers.SweepWorker()
    task.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    resubmitted = task.checkpoint(["sweep=cpu_demo", "sweep.seed=3"])
    assert task.process.returncode == -signal.SIGTERM
    assert isinstance(resubmitted.function, workers.SweepWorker) and resubmitted.function.process is None
    assert resubmitted.args == (["sweep=cpu_demo", "sweep.seed=3"],)
