"""verify: a candidate that trains the same model passes, one that drops tokens fails, by a measured tolerance."""

from __future__ import annotations

import json

import pytest

from moe_vlm_sweep.cli import main
from moe_vlm_sweep.export.verify import HEADROOM, RESOLUTION, check_curve, compare, record
from moe_vlm_sweep.metrics.schema import Loss

REF = [6.0, 5.9, 5.7, 5.6]


def test_the_tolerance_is_the_reference_spread_against_itself():
    perturbed = [6.0, 5.9 + 1e-4, 5.7 - 3e-4, 5.6 + 1e-4]  # spread 0, 1e-4, 3e-4, 1e-4 -> envelope 0, 1e-4, 3e-4, 3e-4
    within = [6.0, 5.9 + HEADROOM * 1e-4 * 0.9, 5.7, 5.6 - HEADROOM * 3e-4 * 0.9]
    check = check_curve(REF, perturbed, within)
    assert check.passed and check.max_deviation_step == 3
    assert check.tolerance == pytest.approx([HEADROOM * e + RESOLUTION * r for e, r in zip([0, 1e-4, 3e-4, 3e-4], REF)])
    # a first-step difference beyond the loss's resolution fails though later steps are noisy: the forward of
    # step 0 is the same under any layout, so only a change of the model (dropped tokens) moves it
    early = check_curve(REF, perturbed, [6.0 + 1e-4, *REF[1:]])
    assert not early.passed and early.worst_step == 0 and early.max_deviation == pytest.approx(1e-4)
    assert not check_curve(REF, perturbed, [*REF[:3], 5.6 + HEADROOM * 3e-4 * 1.1]).passed


def _loss(values: list[float], grad_norms: list[float | None]) -> Loss:
    return Loss(values=values, phases=["measured"] * len(values), grad_norms=grad_norms)


def test_a_gradient_counted_twice_fails_though_the_loss_agrees():
    """The candidate's losses are the reference's; its gradient norms are twice theirs from step 1 (what a
    weight-gradient fusion that adds a micro-batch's gradient twice does, which Adam hides from the loss)."""
    norms = [2.0, 1.5, 1.2, 1.1]
    runs = {
        "reference": _loss(REF, norms),
        "perturbed": _loss(REF, [n * (1 + 1e-5) for n in norms]),
        "candidate": _loss(REF, [norms[0], *(2 * n for n in norms[1:])]),
    }
    verdict = compare(runs)
    assert verdict.status == "fail" and verdict.loss is not None and verdict.loss.passed
    assert verdict.grad_norm is not None and verdict.grad_norm.worst_step == 1 and not verdict.grad_norm.passed
    assert verdict.summary().startswith("verify: FAIL over 4 steps (gradient norm outside the tolerance): ")
    assert "gradient norm: largest gradient norm deviation 1.5 at step 1" in verdict.summary()
    runs["candidate"] = _loss(REF, norms)
    assert compare(runs).passed
    runs["candidate"] = _loss(REF, [*norms[:2], float("nan"), norms[3]])  # a NaN fails, wherever it is
    nan = compare(runs)
    assert not nan.passed and nan.grad_norm is not None and nan.grad_norm.worst_step == 2
    written = json.loads(json.dumps(record(nan, ["model=tiny"], ["model=tiny"]), allow_nan=False))  # strict JSON
    assert written["status"] == "fail" and written["grad_norm"]["candidate"][2] is None
    assert written["grad_norm"]["worst_ratio"] is None and written["loss"]["worst_ratio"] == 0
    assert written["loss"]["passed"] is True and written["grad_norm"]["passed"] is False
    assert "largest gradient norm deviation inf at step 2" in nan.summary()
    runs["candidate"] = _loss(REF, norms)
    runs["perturbed"] = _loss(REF, [*norms[:3], float("nan")])  # a reference that diverged measures no tolerance
    diverged = compare(runs)
    assert not diverged.passed and diverged.grad_norm is not None and diverged.grad_norm.worst_step == 3


def test_steps_without_a_gradient_norm_are_left_out_of_its_check():
    """A step without a norm in any run (None: the optimizer did not report one) is not compared; runs of an
    earlier version, with no norms at all, are compared on their loss alone and the summary says so."""
    runs = {
        "reference": _loss(REF, [2.0, None, 1.2, 1.1]),
        "perturbed": _loss(REF, [2.0, 1.5, 1.2 + 1e-4, 1.1]),
        "candidate": _loss(REF, [2.0, 9.0, 1.2, 1.1]),
    }
    verdict = compare(runs)
    assert verdict.passed and verdict.grad_norm is not None and verdict.grad_norm.steps == [0, 2, 3]
    old = compare({name: _loss(REF, []) for name in runs})
    assert old.passed and old.grad_norm is None and "gradient norm: not compared" in old.summary()


def test_verify_needs_a_reference_and_valid_configs(tmp_path, capsys):
    assert main(["verify", "model=tiny", "--outputs", str(tmp_path)]) == 2
    assert "needs --against" in capsys.readouterr().err
    assert main(["verify", "model=tiny", "batch.mbs=3", "--against", "model=tiny", "--outputs", str(tmp_path)]) == 2
    assert "batch.mbs" in capsys.readouterr().err
    assert not (tmp_path / "verify" / "runs").exists()


def _verify(tmp_path, capsys, candidate: list[str], reference: list[str], *, steps: int) -> tuple[int, str]:
    """``moe-vlm-sweep verify CANDIDATE --against REFERENCE``: (exit code, console)."""
    code = main(["verify", *candidate, "--against", *reference, "--steps", str(steps), "--outputs", str(tmp_path)])
    return code, capsys.readouterr().out


TWO = ["model=tiny", "launcher=torchrun", "launcher.nproc_per_node=2", "batch.gbs=4", "batch.mbs=2"]


@pytest.mark.slow
def test_tp2_sp_passes_against_its_fsdp_reference(tmp_path, capsys):
    code, out = _verify(
        tmp_path, capsys, [*TWO, "parallel=3d", "parallel.tp=2", "parallel.sp=true"], [*TWO, "parallel=fsdp"], steps=6
    )
    assert code == 0, out
    assert "verify: PASS over 6 steps: largest loss deviation" in out and "batch.mbs=1 instead of 2" in out
    assert "gradient norm: largest gradient norm deviation" in out
    record = json.loads((tmp_path / "verify" / "verify.json").read_text())
    assert record["schema_version"] == 2
    assert record["status"] == "pass" and len(record["loss"]["candidate"]) == 6
    assert record["grad_norm"]["steps"] == list(range(6))
    assert record["recipes"]["candidate"]["fingerprint"] == record["recipes"]["reference"]["fingerprint"]
    for curve in ("loss", "grad_norm"):  # the tolerance comes from a real second run
        assert record[curve]["perturbed"] != record[curve]["reference"]


@pytest.mark.slow
def test_a_token_dropping_candidate_fails(tmp_path, capsys):
    one = ["model=tiny", "batch.gbs=4", "batch.mbs=2"]
    dropping = ["dispatcher.capacity_factor=1.0", "dispatcher.pad_to_capacity=true"]
    code, out = _verify(tmp_path, capsys, [*one, *dropping], one, steps=4)
    assert code == 1, out
    assert "verify: FAIL over 4 steps (loss and gradient norm outside the tolerance)" in out
    assert "nearest its tolerance at step 0" in out
    assert "recipes differ" in out and "dispatcher.capacity_factor=1.0" in out


def test_a_study_is_verified_as_its_winner_against_its_first_trial(tmp_path):
    import optuna
    import yaml

    from moe_vlm_sweep.export.verify_command import study_pair

    study = optuna.create_study(direction="maximize")
    for mbs, value in ((1, 1.0), (2, 3.0), (4, 2.0)):
        study.add_trial(
            optuna.trial.create_trial(value=value, user_attrs={"overrides": ["model=tiny", f"batch.mbs={mbs}"]})
        )
    assert study_pair(study, tmp_path) == (1, ["model=tiny", "batch.mbs=2"], ["model=tiny", "batch.mbs=1"])
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "top.yaml").write_text(yaml.safe_dump([{"trial": 2, "confirmed": True}]))
    assert study_pair(study, tmp_path)[:2] == (2, ["model=tiny", "batch.mbs=4"])  # the exported winner
