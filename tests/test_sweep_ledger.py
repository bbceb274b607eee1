"""The study bookkeeping: counting, stale trials, the duplicate claim (real Optuna on SQLite)."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import threading
import time

import optuna
import pytest
from optuna.trial import TrialState

from moe_vlm_sweep.sweep import ledger


@pytest.fixture
def study(tmp_path):
    return optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="s", direction="maximize")


def _dead_worker() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    host, _, start = ledger.worker_id().split(":")
    return f"{host}:{proc.pid}:{start}"


def test_counted_skips_duplicates_and_retried_trials(study):
    for claim in ("launch", "duplicate", "surplus", "launch"):
        trial = study.ask()
        trial.set_user_attr("claim", claim)
        study.tell(
            trial,
            1.0 if claim == "launch" else None,
            state=TrialState.COMPLETE if claim == "launch" else TrialState.PRUNED,
        )
    study.enqueue_trial({}, user_attrs={"retry_of": 3})
    assert [t.number for t in ledger.counted(study.get_trials())] == [0]


def test_a_trial_of_a_dead_local_worker_is_stale_at_once(study):
    trial = study.ask()
    trial.set_user_attr("worker", _dead_worker())
    assert [t.number for t in ledger.stale_trials(study, stale_after_s=3600)] == [trial.number]
    ledger.own(trial)
    assert ledger.stale_trials(study, stale_after_s=3600) == []


def test_a_remote_worker_is_stale_by_its_heartbeat(study):
    trial = study.ask()
    trial.set_user_attr("worker", "elsewhere:1:1")
    trial.set_user_attr("heartbeat", 1000.0)
    frozen = study.get_trials()[0]
    assert ledger.is_stale(frozen, stale_after_s=60, now=1030.0) is False
    assert ledger.is_stale(frozen, stale_after_s=60, now=1100.0) is True


def test_claim_under_a_real_race(study):
    """Many pairs asked at once, each pair with params no earlier trial holds: exactly one of each launches."""
    for i in range(10):
        for _ in range(2):
            study.enqueue_trial({"x": i}, skip_if_exists=False)
        pair = [study.ask(fixed_distributions={"x": optuna.distributions.IntDistribution(0, 9)}) for _ in range(2)]
        assert [t.params for t in pair] == [{"x": i}] * 2
        results: list[int | None] = []
        threads = [
            threading.Thread(target=lambda t=t, i=i, results=results: results.append(ledger.claim(study, t, {"x": i})))
            for t in pair
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        numbers = {t.number for t in pair}
        claims = [t.user_attrs.get("claim") for t in study.get_trials() if t.number in numbers]
        assert sorted(claims) == ["duplicate", "launch"], [t.user_attrs for t in study.get_trials()]
        assert results.count(None) == 1 and set(results) - {None} <= numbers
        for t in pair:
            study.tell(t, 1.0)


def test_surplus_once_the_study_is_full(study):
    for _ in range(2):
        study.tell(study.ask(), 1.0)
    late = study.ask()
    assert ledger.is_surplus(study.get_trials(), late.number, n_trials=2, stale_after_s=60)
    assert not ledger.is_surplus(study.get_trials(), late.number, n_trials=3, stale_after_s=60)


def test_after_a_duplicate_the_next_proposal_is_drawn_at_random(study):
    """A sampler stuck on one config (a one-point grid) proposes it again; `exploring` draws from the explorer."""
    from moe_vlm_sweep.sweep.space import Space
    from moe_vlm_sweep.sweep.study import exploring

    space = Space.parse({"batch.mbs": [1, 2, 4, 8], "vision": ["trainable", "frozen"]})
    study.sampler = optuna.samplers.GridSampler({"batch.mbs": [1], "vision": ["frozen"]})
    explorer = optuna.samplers.RandomSampler(seed=0)
    stuck = [space.suggest(study.ask()) for _ in range(3)]
    assert all(s == {"batch.mbs": 1, "vision": "frozen"} for s in stuck)
    drawn = []
    for _ in range(12):
        with exploring(study, explorer, now=True):
            drawn.append(tuple(space.suggest(study.ask()).values()))
    assert len(set(drawn)) > 3
    assert isinstance(study.sampler, optuna.samplers.GridSampler)  # the study's own sampler is back
    with exploring(study, explorer, now=False):
        assert space.suggest(study.ask()) == {"batch.mbs": 1, "vision": "frozen"}


def test_after_a_repeat_the_next_trial_walks_one_knob_out_from_the_best(study):
    """neighbor_of_best proposes an untried config one knob from the best trial; none once all were tried."""
    import random

    from moe_vlm_sweep.sweep.space import Space
    from moe_vlm_sweep.sweep.study import neighbor_of_best

    space = Space.parse({"batch.mbs": [1, 2, 4], "vision": ["trainable", "frozen"]})
    for mbs, vision, value in ((1, "trainable", 1.0), (2, "trainable", 3.0), (4, "frozen", 2.0)):
        study.add_trial(
            optuna.trial.create_trial(
                params={"batch.mbs": mbs, "vision": vision},
                value=value,
                distributions={
                    "batch.mbs": optuna.distributions.CategoricalDistribution([1, 2, 4]),
                    "vision": optuna.distributions.CategoricalDistribution(["trainable", "frozen"]),
                },
            )
        )
    rng = random.Random(0)
    proposals = set()
    for _ in range(20):
        best, proposal = neighbor_of_best(study, space, rng)
        assert best == 1
        proposals.add(tuple(sorted(proposal.items())))
    # one knob from #1 (mbs 2, trainable), not yet tried: mbs 4 trainable, mbs 2 frozen (mbs 1 trainable was)
    assert proposals == {(("batch.mbs", 4), ("vision", "trainable")), (("batch.mbs", 2), ("vision", "frozen"))}
    study.enqueue_trial({"batch.mbs": 4, "vision": "trainable"})  # waiting counts as tried
    assert neighbor_of_best(study, space, rng) == (1, {"batch.mbs": 2, "vision": "frozen"})
    study.enqueue_trial({"batch.mbs": 2, "vision": "frozen"})
    assert neighbor_of_best(study, space, rng) is None  # every neighbor is taken: the explorer draws instead


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_heartbeat_that_keeps_failing_gives_the_trial_up_past_the_stale_window(tmp_path, caplog):
    """The study's SQLite file is locked by another writer, so every beat fails: a short outage is logged and
    survived; one longer than sweep.resume.stale_after_s loses the claim (another host may re-run the trial), the
    beating stops and the guard stops the trial's worker, instead of the trial running on unseen."""
    db = tmp_path / "s.db"
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}", engine_kwargs={"connect_args": {"timeout": 0.05}})
    study = optuna.create_study(storage=storage, study_name="s")
    trial = study.ask()
    ledger.own(trial)
    beat = ledger.Heartbeat(trial, interval_s=0.1, stale_after_s=1.0)

    def heartbeat() -> float:
        return study.get_trials(deepcopy=False)[0].user_attrs["heartbeat"]

    def locked(seconds: float) -> None:
        writer = sqlite3.connect(db, isolation_level=None)
        writer.execute("BEGIN EXCLUSIVE")
        time.sleep(seconds)
        writer.execute("ROLLBACK")
        writer.close()

    early_stop = beat.guard(lambda run_dir: None)
    with caplog.at_level(logging.WARNING, logger=ledger.__name__), beat:
        first = heartbeat()
        assert _wait_for(lambda: heartbeat() > first, 5)
        locked(0.4)  # a hiccup, well inside the window
        before = heartbeat()
        assert _wait_for(lambda: heartbeat() > before, 5) and beat.lost is None
        assert "heartbeat failed" in caplog.text and "database is locked" in caplog.text
        assert early_stop(tmp_path) is None

        outage = threading.Thread(target=locked, args=(3.0,))
        outage.start()
        assert _wait_for(lambda: beat.lost is not None, 10), "a storage down past the window went unnoticed"
        outage.join()
        assert f"trial #{trial.number} lost its claim" in beat.lost and "stale_after_s=1" in beat.lost
        assert early_stop(tmp_path) == beat.lost  # the launcher stops the worker on its next look
        last = heartbeat()
        time.sleep(0.5)
        assert heartbeat() == last  # the storage is back, but a worker that lost its claim does not beat again
    assert any(r.levelno == logging.ERROR and "lost its claim" in r.getMessage() for r in caplog.records)


def _stop_before_claim(study: optuna.Study, trial: optuna.Trial, failure_class: str | None) -> None:
    """As the sweeper leaves a trial a signal (or a lost worker) stopped while its config was being composed."""
    if failure_class is not None:
        trial.set_user_attr("failure_class", failure_class)
    study.tell(trial, state=TrialState.FAIL)


def test_a_trial_stopped_before_its_claim_neither_counts_nor_holds_its_config(study):
    fixed = {"x": optuna.distributions.CategoricalDistribution([1, 2])}
    interrupted = study.ask(fixed)
    ledger.own(interrupted)
    interrupted.set_user_attr("sampled", True)  # the signal came while it waited in claim
    _stop_before_claim(study, interrupted, "interrupted")
    left_running = study.ask(fixed)  # recovered as stale: told failed, no failure class
    _stop_before_claim(study, left_running, None)
    invalid = study.ask(fixed)
    invalid.set_user_attr("failure_class", "invalid")
    study.tell(invalid, state=TrialState.PRUNED)
    assert [t.number for t in ledger.counted(study.get_trials())] == [invalid.number]

    again = study.ask(fixed)
    assert ledger.claim(study, again, again.params) is None, "a config nothing measured is free to claim"


def test_resume_requeues_the_enqueued_params_of_a_trial_stopped_before_its_claim_once(study):
    from hydra_plugins.moe_vlm_sweep_sweeper._impl import SweeperImpl
    from moe_vlm_sweep.sweep.spec import load_spec

    study.enqueue_trial({"x": 2}, user_attrs={"retry_of": 7})
    first = study.ask({"x": optuna.distributions.CategoricalDistribution([1, 2])})
    _stop_before_claim(study, first, "interrupted")
    sweeper = SweeperImpl.__new__(SweeperImpl)  # the resume step alone: no app, no launcher, no MLflow
    sweeper.project, sweeper.tracker = False, None
    for _ in range(2):  # a second resume queues nothing more
        sweeper._recover(study, load_spec({"n_trials": 1}))
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert [(t.user_attrs, t.system_attrs["fixed_params"]) for t in waiting] == [
        ({"retry_of": 7, "requeue_of": first.number}, {"x": 2})
    ]
    assert ledger.counted(study.get_trials()) == []


def test_a_trial_another_host_failed_first_is_not_told_again(tmp_path, caplog):
    """The heartbeat's claim was lost and another host's resume failed the trial: the sweep logs it, goes on."""
    from hydra_plugins.moe_vlm_sweep_sweeper._impl import Outcome, SweeperImpl

    url = f"sqlite:///{tmp_path / 'lost.db'}"
    study = optuna.create_study(storage=url, study_name="lost", direction="maximize")
    trial = study.ask()
    other_host = (
        "import optuna; optuna.load_study(study_name='lost', storage=%r).tell(0, state=optuna.trial.TrialState.FAIL)"
    )
    subprocess.run([sys.executable, "-c", other_host % url], check=True, timeout=120)
    sweeper = SweeperImpl.__new__(SweeperImpl)  # the tell alone: no app, no launcher, no MLflow
    sweeper.project, sweeper.tracker = False, None
    lost = Outcome(state="fail", failure_class="interrupted", reason="trial #0 lost its claim")
    with caplog.at_level(logging.WARNING):
        sweeper._tell_unless_finished(study, trial, lost)
    assert "already FAIL by another host" in caplog.text
    assert study.get_trials()[0].state == TrialState.FAIL

    study.enqueue_trial({})  # any other refusal is still raised: here telling a trial not yet asked
    waiting = optuna.trial.Trial(study, study.get_trials(states=(TrialState.WAITING,))[0]._trial_id)
    with pytest.raises(ValueError, match="WAITING"):
        sweeper._tell_unless_finished(study, waiting, lost)


def test_a_run_without_result_json_is_read_as_its_launcher_would_have(tmp_path):
    """The sweep died before the launcher wrote result.json: the worker's metrics.json makes the run OK, unless a
    rank died in native code after it (in teardown), which the launcher, seeing that rank's exit status, calls a
    crash; a crash file alone is a finished (crashed) run too."""
    from contract_samples import sample_metrics

    from moe_vlm_sweep.config.compose import compose_run_config
    from moe_vlm_sweep.launch.run_dir import RESULT_FILE, new_run_dir
    from moe_vlm_sweep.launch.status import RunStatus
    from moe_vlm_sweep.metrics.schema import native_crash_file, write_metrics
    from moe_vlm_sweep.plan.plan import make_plan

    plan = make_plan(compose_run_config(["model=tiny", "hardware=cpu"]))
    trial = optuna.trial.create_trial(value=1.0, user_attrs={"overrides": plan.overrides})
    trial.number = 3
    run_dir = new_run_dir(tmp_path, "job3")
    plan.write(run_dir / "plan.json")
    assert ledger.finished_run(trial, tmp_path / "runs") is None  # nothing written yet: not finished

    crash = native_crash_file(run_dir, 1)
    crash.write_text("Fatal Python error: Segmentation fault\n")
    crashed = ledger.finished_run(trial, tmp_path / "runs")
    assert crashed is not None and crashed.status == RunStatus.CRASH and "rank 1" in crashed.reason

    write_metrics(run_dir, sample_metrics())
    for crash_text, status in (("Fatal Python error: Aborted\n", RunStatus.CRASH), ("", RunStatus.OK)):
        (run_dir / RESULT_FILE).unlink()
        crash.write_text(crash_text)
        result = ledger.finished_run(trial, tmp_path / "runs")
        assert result is not None and result.status == status, result
        assert (run_dir / RESULT_FILE).exists() and result.run_dir == str(run_dir)
