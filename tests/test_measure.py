"""The training loop's measurements (``train/measure.py``): what each context manager records, and that each
undoes what it set however the block ends."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from moe_vlm_sweep.train import measure


class _Llava(torch.nn.Module):
    """The three component attributes the profiling hooks look for, as LLaVAModel has them."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_model, self.vision_projection, self.language_model = (torch.nn.Linear(2, 2) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.language_model(self.vision_projection(self.vision_model(x)))


def test_gc_pauses_count_only_inside_a_timer_that_counts_them():
    with measure.GcPauses() as pauses:
        assert pauses in gc.callbacks
        gc.collect()  # outside a timed step: not counted
        with measure.StepTimer("cpu", pauses, count_gc=False):
            gc.collect()
        with measure.StepTimer("cpu", pauses, count_gc=True) as timer:
            gc.collect()
            gc.collect()
    assert pauses not in gc.callbacks
    assert pauses.summary()["count"] == 2 and pauses.summary()["seconds"] > 0
    assert timer.seconds > 0 and not pauses.timing


def test_manual_gc_collects_once_past_warmup_and_turns_the_collector_back_on_after_a_failure():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), measure.ManualGc(True) as manual:
        manual.before("warmup")
        assert gc.isenabled()
        manual.before("measured")
        assert not gc.isenabled()
        raise RuntimeError("a step failed")
    assert gc.isenabled()
    with measure.ManualGc(False) as manual:
        manual.before("measured")
        assert gc.isenabled()


def test_wall_adds_up_per_part():
    wall_s: dict[str, float] = {}
    for _ in range(2):
        with measure.wall(wall_s, "measured"):
            time.sleep(0.05)
    with measure.wall(wall_s, "profile"):
        pass
    assert set(wall_s) == {"measured", "profile"} and wall_s["measured"] >= 0.1 > 0.05 > wall_s["profile"]


def test_profiling_splits_the_profile_steps_by_component_and_leaves_no_hook(tmp_path):
    model = _Llava()
    marks = measure.PhaseMarks("cpu")
    assert marks.span("optimizer") is marks.span("grad_sync")  # inactive: one shared no-op, no marks
    with measure.Profiling([model], marks, tmp_path) as profiling:
        for phase in ("measured", "profile", "profile"):
            profiling.before(phase)
            with profiling.step(phase):
                model(torch.ones(1, 2, requires_grad=True)).sum().backward()
                with marks.span("optimizer"):
                    pass
            if phase == "measured":
                assert not marks.events  # the measured step carries no marks
    split = profiling.split_seconds(2)
    assert {f"{c}.{d}" for c in ("vision_encoder", "projector", "decoder") for d in ("forward", "backward")} <= set(
        split
    )
    assert {"other", "optimizer"} <= set(split) and "end" not in split
    assert not marks.active and marks.span("optimizer") is marks.span("other")
    for module in (model.vision_model, model.vision_projection, model.language_model):
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert (tmp_path / "trace.json").stat().st_size > 0 and "Name" in (tmp_path / "kernels.txt").read_text()
    assert measure.Profiling([model], measure.PhaseMarks("cpu"), None).split_seconds(0) is None
