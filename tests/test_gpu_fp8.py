"""``train.precision=fp8`` on a real FP8 GPU: each of TE's Hopper recipes trains the decoder in FP8 through the
real worker, near the bf16 run's loss, and ``metrics.json`` says which modules ran FP8 by TE's own record.

Skipped on machines without CUDA and Transformer Engine (CI), with that reason; run on an H100 or H200 with
``python -m pytest tests/test_gpu_fp8.py``. Every run trains ``model=tiny`` on one fixed batch from the same seed,
so the bf16 and FP8 runs start from the same weights and see the same data: their losses differ by FP8's
rounding alone (a run costs the GPU machine about 30 s).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from conftest import ok_run, run_in

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="needs a CUDA GPU with Transformer Engine (an H100 or H200); CI has neither",
)

COMMON = (
    "model=tiny",
    "hardware=h100",
    "parallel=3d",
    "batch.mbs=2",
    "batch.gbs=4",
    "train.warmup_steps=2",
    "train.steps=8",
    "train.lr=3e-3",
    "train.profile_steps=0",
    "data.fixed_batch=true",
    "cuda_graph=none",
)

TE_RECIPES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling", "blockwise": "Float8BlockScaling"}
"""``train.fp8_recipe`` -> the TE recipe class megatron's ``fp8_utils.get_fp8_recipe`` builds for it."""


def _run(outputs, *overrides: str) -> dict:
    return ok_run(run_in(outputs, *COMMON, *overrides))[1]


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("bf16"), "train.precision=bf16")


def _te_supports(recipe: str) -> tuple[bool, str]:
    """TE's own verdict on this GPU (block scaling also needs CUDA 12.9); the worker's preflight refuses the
    recipe with this reason where it is false."""
    import transformer_engine.pytorch as te

    check = te.is_fp8_block_scaling_available if recipe == "blockwise" else te.is_fp8_available
    return check(return_reason=True)


@pytest.mark.parametrize("recipe", sorted(TE_RECIPES))
def test_fp8_recipe_trains_the_decoder_in_fp8_near_the_bf16_loss(recipe, bf16, tmp_path):
    supported, reason = _te_supports(recipe)
    assert supported, f"Transformer Engine runs no {recipe} FP8 here: {reason}"
    fp8 = _run(tmp_path, "train.precision=fp8", f"train.fp8_recipe={recipe}")
    assert bf16["fp8"] is None
    scope = fp8["fp8"]
    assert scope["recipe"] == recipe and scope["format"] == "hybrid"
    assert scope["te_recipes"] == [TE_RECIPES[recipe]]  # what TE itself ran, not what was asked
    layers = "language_model.decoder.layers.*."
    assert dict(scope["fp8_modules"]) == {
        f"{layers}self_attention.linear_qkv": 2,  # model=tiny: two decoder layers
        f"{layers}self_attention.linear_proj": 2,
        f"{layers}mlp.experts.linear_fc1": 2,
        f"{layers}mlp.experts.linear_fc2": 2,
    }
    bf16_modules = dict(scope["bf16_modules"])
    assert "language_model.output_layer" in bf16_modules and f"{layers}mlp.router" in bf16_modules
    assert any(name.startswith("vision_model.") for name in bf16_modules)
    assert any(name.startswith("vision_projection.") for name in bf16_modules)

    losses, reference = fp8["loss"]["values"], bf16["loss"]["values"]
    assert all(math.isfinite(v) for v in losses)
    assert losses != reference  # FP8 rounding changes the numbers: the GEMMs really ran in FP8
    assert losses[0] == pytest.approx(reference[0], rel=2e-2)  # the same weights, batch and seed
    assert losses[-1] == pytest.approx(reference[-1], rel=1e-1)
    assert reference[-1] < 0.9 * reference[0] and losses[-1] < 0.9 * losses[0]  # both learn the fixed batch
