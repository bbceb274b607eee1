"""``train.precision=fp8``: a recipe knob the plan carries to the decoder, and megatron-core's own FP8 check
mirrored by the rule table. (Training in FP8 needs an FP8 GPU: ``tests/test_gpu_fp8.py``.)"""

from __future__ import annotations

import pytest

from moe_vlm_sweep.config.compose import CONF_DIR, compose_run_config
from moe_vlm_sweep.config.recipe import Knob, fingerprint, kind
from moe_vlm_sweep.plan.plan import make_plan
from moe_vlm_sweep.plan.rules import broken_rules
from moe_vlm_sweep.sweep.recipe import check_recipe
from moe_vlm_sweep.sweep.space import Space
from moe_vlm_sweep.sweep.spec import SweepSpecError

H100 = ["hardware=h100"]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_fp8_plan_keeps_bf16_tensors_and_names_the_recipe(recipe):
    plan = make_plan(compose_run_config([*H100, "train.precision=fp8", f"train.fp8_recipe={recipe}"]))
    assert plan.precision == "bf16"  # parameters and activations; the decoder's TE GEMMs run in FP8
    assert plan.fp8_recipe == recipe
    assert make_plan(compose_run_config(H100)).fp8_recipe is None


def test_fp8_is_a_recipe_change_a_search_needs_an_opt_in_for():
    assert kind("train.precision") is Knob.RECIPE and kind("train.fp8_recipe") is Knob.RECIPE
    assert kind("hardware.fp8") is Knob.PERFORMANCE
    bf16, fp8 = (compose_run_config([*H100, f"train.precision={p}"]) for p in ("bf16", "fp8"))
    assert fingerprint(bf16) != fingerprint(fp8)
    delayed, blockwise = (
        compose_run_config([*H100, "train.precision=fp8", f"train.fp8_recipe={r}"]) for r in ("delayed", "blockwise")
    )
    assert fingerprint(delayed) != fingerprint(blockwise)
    space = Space.parse({"train.precision": ["bf16", "fp8"], "train.fp8_recipe": ["delayed", "tensorwise"]})
    with pytest.raises(SweepSpecError, match=r"sweep.params.train.precision varies train.precision"):
        check_recipe(space, [], CONF_DIR)
    assert set(check_recipe(space, ["train.precision", "train.fp8_recipe"], CONF_DIR)) == {
        "train.precision",
        "train.fp8_recipe",
    }


@pytest.mark.parametrize("hardware,fp8", [("cpu", False), ("h100", True), ("h200", True), ("b200", True)])
def test_each_hardware_says_whether_it_runs_fp8(hardware, fp8):
    assert compose_run_config([f"hardware={hardware}"]).hardware.fp8 is fp8


def test_the_delayed_recipe_rule_mirrors_megatron_core():
    """megatron-core's TransformerConfig refuses delayed scaling with moe_act recompute; the rule says so first."""
    from moe_vlm_sweep.model.build import decoder_config

    overrides = [*H100, "train.precision=fp8", "recompute=selective", "recompute.modules=[moe_act]"]
    cfg = compose_run_config(overrides)
    assert any("train.fp8_recipe=delayed cannot recompute" in m for m in broken_rules(cfg))
    with pytest.raises(ValueError, match="Delayed scaling does not support moe_act and layernorm recompute"):
        decoder_config(make_plan(cfg, validate=False))


def test_fp8_dims_rule_accepts_the_shipped_models_at_an_aligned_sequence():
    """model=small (1599 tokens) and the proxy (2623) are odd: MBS 8 or a text length one token longer aligns."""
    for model, text_tokens in (("small", 1025), ("qwen3_vl_30b_a3b_proxy", 2049)):
        cfg = compose_run_config([*H100, f"model={model}", "train.precision=fp8", f"model.text_tokens={text_tokens}"])
        assert not [m for m in broken_rules(cfg) if "train.precision=fp8" in m], model
    odd = compose_run_config([*H100, "model=small", "train.precision=fp8"])
    assert any("needs batch.mbs a multiple of 8" in m for m in broken_rules(odd))


def test_block_scaling_asks_16_of_the_tokens_too():
    """TE's cuBLASLt call for block-scaled GEMMs wants a leading dimension of 16; the weight-gradient GEMM reduces
    over the tokens. model=tiny at 69 text tokens: 84-token rows, 168 tokens per micro-batch of 2."""

    def fp8_refusals(recipe: str) -> list[str]:
        cfg = compose_run_config([*H100, "train.precision=fp8", f"train.fp8_recipe={recipe}", "model.text_tokens=69"])
        return [m for m in broken_rules(cfg) if "train.precision=fp8" in m]

    assert fp8_refusals("delayed") == fp8_refusals("tensorwise") == []
    (message,) = fp8_refusals("blockwise")
    assert "rows to be a multiple of 16" in message and "needs batch.mbs a multiple of 4" in message


def test_fp8_adds_te_weight_copies_and_counts_layer_activations_at_one_byte():
    """The proxy's decoder GEMMs (4 layers: 128 experts of 3 x 2048 x 768, attention 2048 x 9216) in FP8, rowwise
    and transposed: 2 bytes a weight on top of the bf16 run's estimate; the decoder layers' saved activations at
    one byte an element instead of two, everything else as in bf16."""
    from moe_vlm_sweep.plan.memory import GIB, activation_parts, estimate, fp8_weight_bytes

    common = [*H100, "model=qwen3_vl_30b_a3b_proxy", "parallel=3d", "batch.mbs=2", "batch.gbs=8"]
    bf16, fp8 = (compose_run_config([*common, f"train.precision={p}"]) for p in ("bf16", "fp8"))
    gemm_weights = 4 * (128 * 3 * 2048 * 768 + 2048 * 128 * (2 * 32 + 2 * 4))
    assert fp8_weight_bytes(fp8) == 2 * gemm_weights and fp8_weight_bytes(bf16) == 0
    seq = make_plan(bf16).seq_length
    parts = {name: activation_parts(cfg, seq) for name, cfg in (("bf16", bf16), ("fp8", fp8))}
    # half, but for what is not an element of the layer's dtype (the router's fp32 probabilities, indices)
    assert (
        parts["bf16"]["decoder.layers"] / 2 <= parts["fp8"]["decoder.layers"] < 0.51 * parts["bf16"]["decoder.layers"]
    )
    assert {k: v for k, v in parts["fp8"].items() if k != "decoder.layers"} == {
        k: v for k, v in parts["bf16"].items() if k != "decoder.layers"
    }
    assert estimate(fp8).static_gib == pytest.approx(estimate(bf16).static_gib + 2 * gemm_weights / GIB)
    assert estimate(fp8).total_gib < estimate(bf16).total_gib + 2 * gemm_weights / GIB


def test_the_fp8_scope_in_metrics_is_no_tracked_metric():
    """MLflow metric names allow no ``*``: the module counts are [name, count] pairs, which tracking skips."""
    from moe_vlm_sweep.tracking.mlflow_sink import _metrics

    fp8 = {
        "recipe": "delayed",
        "format": "hybrid",
        "te_recipes": ["DelayedScaling"],
        "fp8_modules": [["language_model.decoder.layers.*.self_attention.linear_qkv", 2]],
        "bf16_modules": [["language_model.output_layer", 1]],
    }
    assert [m.key for m in _metrics({"mfu": 0.1, "fp8": fp8}, 0)] == ["mfu"]


def test_under_full_recompute_fp8_layers_keep_their_bf16_inputs():
    from moe_vlm_sweep.plan.memory import activation_parts

    common = [*H100, "model=qwen3_vl_30b_a3b_proxy", "parallel=3d", "batch.mbs=2", "batch.gbs=8", "recompute=full"]
    bf16, fp8 = (compose_run_config([*common, f"train.precision={p}"]) for p in ("bf16", "fp8"))
    seq = make_plan(bf16).seq_length
    assert activation_parts(fp8, seq)["decoder.layers"] == activation_parts(bf16, seq)["decoder.layers"] > 0
