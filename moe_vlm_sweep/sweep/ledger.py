"""What the study's trials mean for this sweep: which count, which are stale, which config is taken.

Optuna stores the trials; these user attributes, written by the sweeper, give them their sweep meaning:

- ``worker`` (``host:pid:start``) and ``heartbeat`` (epoch s): who runs a RUNNING trial and when it last said so.
  A RUNNING trial is stale when its worker is gone: on this host that is checked at once (the pid), elsewhere
  by the heartbeat's age. A killed sweep is therefore resumed at once by the same command on the same host.
- ``claim``: ``launch`` once the trial owns its config, ``duplicate`` when another trial had it first.
- ``failure_class`` / ``reason``: the outcome, for people, MLflow and ``best``.
- ``retry_of``: on a trial re-running an interrupted one (``sweep.resume.stale=retry``); the interrupted
  trial then no longer counts toward ``sweep.n_trials``.
- ``requeue_of``: on a queued trial taking the fixed params (a first trial, a retry, a proposal) of one stopped
  before it claimed them (:func:`stopped_unclaimed`).

A stale trial whose run finished anyway (the sweep was killed while its worker wrote the result) is found by its
run directory (:func:`finished_run`) and its result kept, never measured again.

Why not Optuna's own heartbeat (``RDBStorage(heartbeat_interval=..., grace_period=...,
heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(...))`` with ``optuna.storages.fail_stale_trials``):
it could take over the beat and the age test on SQL storages, and would judge age by the database's clock
(``now()``) rather than each host's, so skewed clocks could not make a live trial look stale. It cannot take over
the rest: its thread runs only inside ``study.optimize`` (the sweeper asks and tells, so it would beat by hand as
here); ``JournalStorage`` and in-memory studies have no heartbeat; staleness is age only, so a killed sweep's trial
on this host waits out the grace period instead of being seen dead at once by its pid; ``fail_stale_trials`` marks
the trial FAIL with no word of why, where the sweeper first keeps a result the run finished anyway, then records
it as interrupted (not failed) for MLflow and ``best``; and its retry callback re-queues every stale trial up to
``max_retry`` times, keyed in system attributes, where a trial is re-run once and only if it had claimed its
config (``claim``/``retry_of`` above, which :func:`counted` reads). Taking only the beat would split one trial's
liveness between two places, so all of it stays here.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from moe_vlm_sweep.launch.local import classify
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.run_dir import RESULT_FILE
from moe_vlm_sweep.launch.status import RunStatus
from moe_vlm_sweep.metrics.schema import FAILURE_FILE, METRICS_FILE, first_native_crash
from moe_vlm_sweep.plan.plan import RunPlan

logger = logging.getLogger(__name__)

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
CLAIM_WAIT_S = 60.0
NOT_COUNTED = (RunStatus.DUPLICATE, RunStatus.SURPLUS)
"""Claims of trials that never ran: a config another trial had first, or a trial asked once the study was full."""


def worker_id() -> str:
    """host:pid:start time, so a recycled pid is never mistaken for a live sweep."""
    proc = psutil.Process()
    return f"{socket.gethostname()}:{proc.pid}:{int(proc.create_time())}"


def _worker_alive(worker: str) -> bool | None:
    """True/False for a worker on this host; None when it runs elsewhere (only its heartbeat can tell)."""
    try:
        host, pid, start = worker.rsplit(":", 2)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    try:
        return int(psutil.Process(int(pid)).create_time()) == int(start)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def is_stale(trial: FrozenTrial, stale_after_s: float, now: float | None = None) -> bool:
    if trial.state != TrialState.RUNNING:
        return False
    worker = trial.user_attrs.get("worker")
    if worker == worker_id():
        return False
    alive = _worker_alive(worker) if worker else None
    if alive is not None:
        return not alive
    beat = trial.user_attrs.get("heartbeat", trial.datetime_start.timestamp() if trial.datetime_start else 0)
    return (now or time.time()) - float(beat) > stale_after_s


def retried_numbers(trials: Iterable[FrozenTrial]) -> set[int]:
    return {int(t.user_attrs["retry_of"]) for t in trials if "retry_of" in t.user_attrs}


def unretried_interrupts(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Launched trials a signal interrupted (failure class ``interrupted``) that no retry re-runs yet."""
    retried = retried_numbers(trials)
    return [
        t
        for t in trials
        if t.state == TrialState.FAIL
        and t.user_attrs.get("failure_class") == RunStatus.INTERRUPTED
        and t.user_attrs.get("claim") == "launch"
        and "retry_of" not in t.user_attrs
        and t.number not in retried
    ]


def stopped_unclaimed(trial: FrozenTrial) -> bool:
    """A trial failed by a stop (a signal, a lost worker) before it claimed its config: nothing of it ran, so it
    neither counts nor holds its config. An invalid config, told before any claim, is not one: the sampler
    learns from it, so it counts."""
    return (
        trial.state == TrialState.FAIL
        and "claim" not in trial.user_attrs
        and trial.user_attrs.get("failure_class") in (None, RunStatus.INTERRUPTED)
    )


def unqueued_unclaimed(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Trials stopped before their claim whose fixed params (an enqueued trial's) no queued trial takes yet: a
    sampled trial needs nothing, the next ask samples afresh, but an enqueued one's params would be lost."""
    requeued = {int(t.user_attrs["requeue_of"]) for t in trials if "requeue_of" in t.user_attrs}
    return [t for t in trials if stopped_unclaimed(t) and "fixed_params" in t.system_attrs and t.number not in requeued]


def counted(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Finished trials that count toward ``sweep.n_trials``: not duplicates, not interrupted-and-retried, not
    stopped before their claim."""
    retried = retried_numbers(trials)
    return [
        t
        for t in trials
        if t.state in FINISHED
        and t.user_attrs.get("claim") not in NOT_COUNTED
        and t.number not in retried
        and not stopped_unclaimed(t)
    ]


def in_flight(trials: list[FrozenTrial], stale_after_s: float) -> list[FrozenTrial]:
    """RUNNING trials of live workers (they will count once finished). Queued retries are not: the next ask
    takes them, and until then the trial they replace no longer counts, so a slot stays open for them."""
    return [
        t
        for t in trials
        if t.state == TrialState.RUNNING
        and not is_stale(t, stale_after_s)
        and t.user_attrs.get("claim") not in NOT_COUNTED
    ]


def is_surplus(trials: list[FrozenTrial], number: int, n_trials: int, stale_after_s: float) -> bool:
    """True when ``n_trials`` trials numbered before ``number`` already count or run: two workers asked for the
    last slot at once, and the later one must not run."""
    ahead = {t.number for t in counted(trials) + in_flight(trials, stale_after_s) if t.number < number}
    return len(ahead) >= n_trials


def stale_trials(study: optuna.Study, stale_after_s: float) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if is_stale(t, stale_after_s)]


def holders(trials: list[FrozenTrial], params: dict[str, Any], number: int) -> list[FrozenTrial]:
    """Other trials that hold ``params``: sampled (complete params), not duplicates, not superseded retries, not
    stopped before their claim."""
    retried = retried_numbers(trials)
    return [
        t
        for t in trials
        if t.number != number
        and t.user_attrs.get("sampled")
        and t.user_attrs.get("claim") not in NOT_COUNTED
        and t.number not in retried
        and not stopped_unclaimed(t)
        and t.state != TrialState.WAITING
        and t.params == params
    ]


def claim(study: optuna.Study, trial: optuna.Trial, params: dict[str, Any]) -> int | None:
    """Claim ``params`` for ``trial``; return None if it owns them, else the number of the trial that does.

    Write-then-read, so two workers that sample the same config at once never both launch it: the trial marks
    itself ``sampled``, then looks. A lower-numbered holder wins outright; a higher-numbered one wins only if
    it already claimed, so the lower one waits for a higher one that has not decided yet (higher ones never
    wait), which cannot deadlock.
    """
    trial.set_user_attr("sampled", True)
    deadline = time.monotonic() + CLAIM_WAIT_S
    while True:
        others = holders(study.get_trials(deepcopy=False), params, trial.number)
        lower = [t.number for t in others if t.number < trial.number]
        higher_claimed = [t.number for t in others if t.user_attrs.get("claim") == "launch"]
        undecided = [
            t
            for t in others
            if t.number > trial.number and "claim" not in t.user_attrs and t.state == TrialState.RUNNING
        ]
        if lower or higher_claimed:
            trial.set_user_attr("claim", RunStatus.DUPLICATE)
            return min(lower + higher_claimed)
        if not undecided or time.monotonic() > deadline:
            trial.set_user_attr("claim", "launch")
            return None
        time.sleep(0.2)


def own(trial: optuna.Trial) -> None:
    """Mark a just-asked trial as this worker's, before anything can go wrong with it."""
    trial.set_user_attr("worker", worker_id())
    trial.set_user_attr("heartbeat", time.time())


def _causes(exc: BaseException) -> str:
    """``exc`` and what it was raised from, one line: a storage wraps the database's own error (``database is
    locked``) in one of its own."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return " <- ".join(f"{type(e).__name__}: {' '.join(str(e).split())[:200]}" for e in chain)


class Heartbeat:
    """Records ``heartbeat`` on the running trial every ``interval_s`` from a daemon thread.

    A beat that fails is logged, and the next one retries: one storage hiccup must not kill a trial. But once
    no beat has been recorded for ``stale_after_s``, another host may declare the trial stale and run it again,
    so this worker has lost its claim: the thread stops beating, ``lost`` says why, and :meth:`guard` stops the
    trial's worker through the launcher's watch instead of letting it run on unseen beside its re-run."""

    def __init__(self, trial: optuna.Trial, interval_s: float, stale_after_s: float):
        self._trial, self._interval, self._stale_after = trial, interval_s, stale_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{trial.number}", daemon=True)
        self._last = time.time()  # :func:`own` recorded one as the trial was asked
        self.lost: str | None = None
        """Why this worker no longer owns the trial, or None while it does."""

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._trial.set_user_attr("heartbeat", time.time())
                self._last = time.time()
            except Exception as exc:
                silent = time.time() - self._last
                error = _causes(exc)
                if silent <= self._stale_after:
                    logger.warning(
                        "trial #%d: heartbeat failed, none recorded for %.0f s of sweep.resume.stale_after_s=%g: %s",
                        self._trial.number,
                        silent,
                        self._stale_after,
                        error,
                    )
                    continue
                self.lost = (
                    f"trial #{self._trial.number} lost its claim: no heartbeat recorded for {silent:.0f} s, past "
                    f"sweep.resume.stale_after_s={self._stale_after:g}, so another host may run it again "
                    f"(last error: {error})"
                )
                logger.error("%s; stopping it", self.lost)
                return

    def guard(self, watch: Callable[[Path], str | None] | None) -> Callable[[Path], str | None]:
        """``watch`` (the launcher's check while the worker runs, e.g. an early stop), stopping the worker first
        once the claim is lost."""

        def guarded(run_dir: Path) -> str | None:
            if self.lost is not None:
                return self.lost
            return watch(run_dir) if watch is not None else None

        return guarded

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def finished_run(trial: FrozenTrial | optuna.Trial, runs_dir: Path) -> RunResult | None:
    """The result of ``trial``'s run if it finished, else None (a stale trial's, or this process's own when a
    signal stops it just after its worker wrote the result).

    The task names a trial's run directory ``<time>-job<number>-<random>`` (``sweep/app.py``); the one of this
    trial is the one made after the trial started whose plan ran the trial's overrides. Its ``result.json``
    is the launcher's verdict; without it (the sweep died before writing it) the worker's own ``metrics.json``,
    ``failure.json`` or a rank's native crash file is classified as the launcher would have, and ``result.json``
    written."""
    started = trial.datetime_start.timestamp() if trial.datetime_start else 0.0
    overrides = trial.user_attrs.get("overrides")
    if overrides is None or not runs_dir.is_dir():
        return None
    for run_dir in sorted(runs_dir.glob(f"*-job{trial.number}-*"), reverse=True):
        try:
            if run_dir.stat().st_mtime < started - 1 or RunPlan.read(run_dir / "plan.json").overrides != overrides:
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (run_dir / RESULT_FILE).exists():
            result = RunResult.read(run_dir)
        elif (run_dir / METRICS_FILE).exists() or (run_dir / FAILURE_FILE).exists() or first_native_crash(run_dir):
            plan = RunPlan.read(run_dir / "plan.json")
            # the exit status the launcher saw: 0 where metrics.json was written and no rank died in native code
            # after it (in teardown), which the launcher calls a crash too
            exited_0 = (run_dir / METRICS_FILE).exists() and first_native_crash(run_dir) is None
            result = classify(run_dir, 0 if exited_0 else 1, False, plan.run_config.train.timeout_s)
            result.run_dir = str(run_dir)
            result.write(run_dir)
        else:
            return None
        result.run_dir = str(run_dir)
        return result
    return None
