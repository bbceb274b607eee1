"""The GPU path on a real CUDA device: TE specs, bf16, TE CUDA graphs of LLaVA's decoder layers, packed THD rows.

Skipped on machines without CUDA and Transformer Engine (CI), with that reason; run on the GPU machine with
``python -m pytest tests/test_gpu_graphs.py``. A graphed run must graph every decoder layer and train the same
model as the eager run: same data and seed, so the losses agree to bf16 noise.
The decoder runs 128 tokens (``model.text_tokens=113``): on cuDNN <= 9.15 the worker's preflight refuses graphed
attention at a length TE would run unfused (``machine_rules.graphs_unfuse_attention``).
"""

from __future__ import annotations

import pytest
from conftest import GPU_TINY, needs_cuda_te, ok_run, run_in

pytestmark = needs_cuda_te

COMMON = (
    *GPU_TINY,
    "train.warmup_steps=3",
    "train.steps=4",
    "train.profile_steps=1",
    "data.fixed_batch=true",
)


def _run(outputs, *overrides: str) -> dict:
    return ok_run(run_in(outputs, *COMMON, *overrides))[1]


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> dict:
    """One eager run for every scope to match (a run costs the GPU machine about 30 s)."""
    return _run(tmp_path_factory.mktemp("eager"), "cuda_graph=none")


@pytest.mark.parametrize("scope", ["attn", "attn_moe_router", "attn_moe_router_preprocess"])
def test_te_graph_scope_graphs_every_layer_and_trains_like_eager(scope, eager, tmp_path):
    graphed = _run(tmp_path, f"cuda_graph={scope}")
    assert eager["graphed_layers"] == 0
    assert graphed["graphed_layers"] == 2  # model=tiny: two decoder layers
    assert eager["saved_activations"]["measured_gib"]["total"] > 0  # the census step runs on the GPU too
    assert graphed["saved_activations"] is None  # and never under graphs, whose capture it would disturb
    assert graphed["loss"]["values"] == pytest.approx(eager["loss"]["values"], rel=2e-2)


def test_packed_thd_run_trains_like_the_padded_one_on_real_tokens_only(eager, tmp_path):
    """``data.packing``: the same samples back to back in TE's THD attention, split at cu_seqlens. Each sample
    attends to itself only, so the loss over real tokens is the padded run's; padding is no longer computed."""
    packed = _run(tmp_path, "cuda_graph=none", "data.packing=true")
    assert eager["real_tokens_per_step"] < eager["padded_tokens_per_step"]  # the padded run computes padding
    assert packed["real_tokens_per_step"] == packed["padded_tokens_per_step"] == eager["real_tokens_per_step"]
    assert packed["flops_per_step"]["total"]["model"] == pytest.approx(eager["flops_per_step"]["total"]["model"])
    assert packed["loss"]["values"][0] == pytest.approx(eager["loss"]["values"][0], rel=1e-2)
    assert packed["loss"]["values"] == pytest.approx(eager["loss"]["values"], rel=2e-2)
