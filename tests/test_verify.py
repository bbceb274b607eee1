"""verify: a candidate that trains the same model passes, one that drops tokens fails, by a measured tolerance."""

from __future__ import annotations

import json

import pytest

from moe_vlm_sweep.cli import main
from moe_vlm_sweep.export.verify import HEADROOM, LOSS_RESOLUTION, compare

REF = [6.0, 5.9, 5.7, 5.6]


def test_the_tolerance_is_the_reference_spread_against_itself():
    perturbed = [6.0, 5.9 + 1e-4, 5.7 - 3e-4, 5.6 + 1e-4]  # spread 0, 1e-4, 3e-4, 1e-4 -> envelope 0, 1e-4, 3e-4, 3e-4
    within = [6.0, 5.9 + HEADROOM * 1e-4 * 0.9, 5.7, 5.6 - HEADROOM * 3e-4 * 0.9]
    verdict = compare(REF, perturbed, within)
    assert verdict.passed and verdict.max_deviation_step == 3
    assert verdict.tolerance == pytest.approx(
        [HEADROOM * e + LOSS_RESOLUTION * r for e, r in zip([0, 1e-4, 3e-4, 3e-4], REF)]
    )
    # a first-step difference beyond the loss's resolution fails though later steps are noisy: the forward of
    # step 0 is the same under any layout, so only a change of the model (dropped tokens) moves it
    early = compare(REF, perturbed, [6.0 + 1e-4, *REF[1:]])
    assert not early.passed and early.worst_step == 0 and early.max_deviation == pytest.approx(1e-4)
    assert not compare(REF, perturbed, [*REF[:3], 5.6 + HEADROOM * 3e-4 * 1.1]).passed


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
    assert "verify: PASS: largest loss deviation" in out and "batch.mbs=1 instead of 2" in out
    record = json.loads((tmp_path / "verify" / "verify.json").read_text())
    assert record["status"] == "pass" and len(record["candidate"]) == 6
    assert record["recipes"]["candidate"]["fingerprint"] == record["recipes"]["reference"]["fingerprint"]
    assert record["perturbed"] != record["reference"]  # the tolerance comes from a real second run


@pytest.mark.slow
def test_a_token_dropping_candidate_fails(tmp_path, capsys):
    one = ["model=tiny", "batch.gbs=4", "batch.mbs=2"]
    dropping = ["dispatcher.capacity_factor=1.0", "dispatcher.pad_to_capacity=true"]
    code, out = _verify(tmp_path, capsys, [*one, *dropping], one, steps=4)
    assert code == 1, out
    assert "verify: FAIL" in out and "nearest its tolerance at step 0" in out
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
