"""The FLOPs accounting (moe_vlm_sweep/model/flops.py) against what the real model runs.

The real LLaVA MoE model is built with the project's builder on the CPU (world 1, gloo, cpu_compat) and run
under ``torch.utils.flop_counter.FlopCounterMode``, forward alone and forward + backward (backward = the
difference). What the counter sees is the *executed* work: the analytic executed count must match it per
component, forward and backward. It matches exactly; a drift means the model changed, not rounding.

*Useful* work is not observable directly (the local attention computes the full square and masks it; padding
runs like text), so it is rebuilt from measurements: the decoder's executed forward is ``a * S + b * S^2`` per
sample of length S; two lengths pin ``a`` (per token) and ``b`` (per query-key pair), and the useful count of a
padded batch must be ``a * sum(L) + b * sum(L (L + 1) / 2)`` over the real lengths L.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moe_vlm_sweep.config.schema import (
    BatchConf,
    DataConf,
    DecoderConf,
    ModelConf,
    ParallelConf,
    RecomputeConf,
    RunConfig,
    VisionTrainingConf,
)
from moe_vlm_sweep.data.batch import pack
from moe_vlm_sweep.data.synthetic import SyntheticImages
from moe_vlm_sweep.metrics.schema import COMPONENTS
from moe_vlm_sweep.model.flops import BatchTokens, component_work, step_flops
from moe_vlm_sweep.plan.plan import make_plan

MBS = 2


def _config(*, text_tokens: int = 65, decoder: dict | None = None, **groups) -> RunConfig:
    model = ModelConf(text_tokens=text_tokens, decoder=DecoderConf(**(decoder or {})))
    return RunConfig(model=model, batch=BatchConf(mbs=MBS, gbs=MBS), parallel=ParallelConf(strategy="3d"), **groups)


def _components(counter: FlopCounterMode) -> dict[str, int]:
    """Per component. The decoder is the rest of the whole: ModTracker attributes the vision and projector
    backward, which run after the decoder's, to the decoder too; LLaVA's own glue has no matmuls."""
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    vision = counts.get("LLaVAModel.vision_model", 0)
    projector = counts.get("LLaVAModel.vision_projection", 0)
    return {
        "vision_encoder": vision,
        "projector": projector,
        "decoder": counts["Global"] - vision - projector,
        "projector.first_layer": counts.get("LLaVAModel.vision_projection.encoder.linear_fc1", 0),
    }


def _count(cfg: RunConfig, data: DataConf | None = None) -> tuple[dict, dict, BatchTokens]:
    """(forward, backward) FLOPs per component as FlopCounterMode counts them, and the batch's tokens."""
    from moe_vlm_sweep.model.build import build_model_chunks
    from moe_vlm_sweep.train.loop import packed_inputs

    plan = make_plan(cfg)
    torch.manual_seed(0)
    model = build_model_chunks(plan)[0]
    mb = SyntheticImages(cfg.model, data or DataConf(), micro_batch_size=MBS).microbatch(0, 0)
    if cfg.data.packing:
        mb = pack(mb)

    def loss():
        per_token, mask = model(
            images=mb.images,
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            labels=mb.labels,
            loss_mask=mb.loss_mask,
            **packed_inputs(mb, plan.seq_length, plan.transformer_impl),
        )
        return (per_token * mask).sum()

    with FlopCounterMode(display=False) as forward:
        loss()
    with FlopCounterMode(display=False) as both:
        loss().backward()
    fwd, total = _components(forward), _components(both)
    batch = BatchTokens.from_lengths(
        mb.decoder_lengths.tolist(), images=mb.images.shape[0], seq_length=plan.seq_length, packed=mb.packed
    )
    return fwd, {k: total[k] - fwd[k] for k in fwd}, batch


CONFIGS = {
    "trainable_gqa_top2": _config(),
    "frozen_encoder": _config(vision=VisionTrainingConf(freeze_encoder=True)),
    "frozen_projector": _config(vision=VisionTrainingConf(freeze_projector=True)),
    "frozen_vision": _config(vision=VisionTrainingConf(freeze_encoder=True, freeze_projector=True)),
    "top1": _config(decoder={"moe_router_topk": 1}),
    "mha": _config(decoder={"num_query_groups": 4}),
    "mqa_top4": _config(decoder={"num_query_groups": 1, "moe_router_topk": 4}),
    "recompute_full": _config(recompute=RecomputeConf(granularity="full", method="uniform", num_layers=1)),
    "recompute_core_attn": _config(recompute=RecomputeConf(granularity="selective", modules=["core_attn"])),
    "dense_and_shared_experts": _config(decoder={"moe_layer_freq": 2, "moe_shared_expert_intermediate_size": 32}),
    "packed": _config(data=DataConf(packing=True)),  # one row of real tokens, attention over its square, masked
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_executed_flops_match_flop_counter_per_component(name, megatron_world):
    cfg = CONFIGS[name]
    fwd, bwd, batch = _count(cfg)
    assert batch.real_tokens < batch.samples * batch.seq_length  # the batch has real padding (dropped if packed)
    work = component_work(cfg, batch, transformer_impl="local")
    for component in COMPONENTS:
        # The acceptance bound is 2%; the count is exact, so it is held exact.
        assert work[component].executed_forward == pytest.approx(fwd[component], rel=1e-9), component
        assert work[component].executed_backward == pytest.approx(bwd[component], rel=1e-9), component


def test_useful_decoder_flops_follow_from_measured_coefficients(megatron_world):
    per_sample = {}
    for text_tokens in (33, 65):  # unpadded batches of two sequence lengths
        cfg = _config(text_tokens=text_tokens)
        fwd, bwd, batch = _count(cfg, DataConf(min_text_fraction=1.0))
        assert batch.real_tokens == batch.padded_tokens
        assert bwd["decoder"] == 2 * fwd["decoder"]
        per_sample[batch.seq_length] = fwd["decoder"] / MBS
    (s1, c1), (s2, c2) = sorted(per_sample.items())
    per_pair = (c2 / s2 - c1 / s1) / (s2 - s1)  # c(S) = per_token * S + per_pair * S^2
    per_token = c1 / s1 - per_pair * s1

    cfg = _config()
    _, _, padded = _count(cfg)  # min_text_fraction 0.5: real padding
    decoder = component_work(cfg, padded, transformer_impl="local")["decoder"]
    assert decoder.useful_forward == pytest.approx(
        per_token * padded.real_tokens + per_pair * padded.real_attention_pairs, rel=1e-9
    )
    assert decoder.useful_backward == 2 * decoder.useful_forward  # recompute never counts as useful
    assert decoder.executed_forward == pytest.approx(
        per_token * padded.padded_tokens + per_pair * padded.samples * padded.seq_length**2, rel=1e-9
    )


def test_frozen_encoder_drops_exactly_its_backward(megatron_world):
    trainable_fwd, trainable_bwd, batch = _count(CONFIGS["trainable_gqa_top2"])
    frozen_fwd, frozen_bwd, same = _count(CONFIGS["frozen_encoder"])
    assert same == batch
    encoder_backward = trainable_bwd["vision_encoder"]
    assert encoder_backward > 0 and frozen_bwd["vision_encoder"] == 0
    counted = {
        name: sum(f[c] + b[c] for c in COMPONENTS)
        for name, f, b in (("trainable", trainable_fwd, trainable_bwd), ("frozen", frozen_fwd, frozen_bwd))
    }
    assert counted["trainable"] - counted["frozen"] == encoder_backward  # what runs: exactly that

    def useful(cfg):
        return step_flops(cfg, batch, transformer_impl="local")

    base, frozen = useful(CONFIGS["trainable_gqa_top2"]), useful(CONFIGS["frozen_encoder"])
    assert base["vision_encoder"].model - frozen["vision_encoder"].model == encoder_backward
    assert frozen["decoder"] == base["decoder"]
    # Behind a frozen encoder, the gradient the projector's first layer computes for its input (the encoder's
    # output) is useless: megatron still runs it (executed unchanged), useful work loses it too.
    assert frozen["projector"].hardware == base["projector"].hardware
    assert base["projector"].model - frozen["projector"].model == trainable_fwd["projector.first_layer"]


def test_fully_frozen_vision_costs_its_forward_only(megatron_world):
    batch = _count(CONFIGS["trainable_gqa_top2"])[2]
    base = component_work(CONFIGS["trainable_gqa_top2"], batch, transformer_impl="local")
    frozen = component_work(CONFIGS["frozen_vision"], batch, transformer_impl="local")
    for component in ("vision_encoder", "projector"):
        assert frozen[component].useful_backward == frozen[component].executed_backward == 0
        assert frozen[component].useful_forward == base[component].useful_forward
    assert frozen["decoder"] == base["decoder"]


# Pure accounting rules (no model).


def _work(cfg: RunConfig, **batch) -> dict:
    tokens = (
        BatchTokens.unpadded(samples=4, images=4 * cfg.model.images_per_sample, seq_length=cfg.model.seq_length)
        if not batch
        else BatchTokens(**batch)
    )
    return component_work(cfg, tokens, transformer_impl="local")


@pytest.mark.parametrize(
    "recompute",
    [
        RecomputeConf(granularity="full", method="uniform", num_layers=1),
        RecomputeConf(granularity="selective", modules=["core_attn"]),
        RecomputeConf(granularity="selective", modules=["moe"]),
    ],
)
def test_recompute_counts_in_executed_flops_only(recompute):
    base, rc = _work(_config())["decoder"], _work(_config(recompute=recompute))["decoder"]
    assert (rc.useful_forward, rc.useful_backward) == (base.useful_forward, base.useful_backward)
    assert rc.executed_backward > base.executed_backward
    full = _work(_config(recompute=RecomputeConf(granularity="full", method="uniform", num_layers=1)))["decoder"]
    assert rc.executed_backward <= full.executed_backward < base.executed_backward + base.executed_forward


def test_topk_shared_experts_and_gqa_move_decoder_flops():
    def decoder(**fields):
        return _work(_config(decoder=fields))["decoder"].useful_forward

    assert decoder(moe_router_topk=1) < decoder(moe_router_topk=2) < decoder(moe_router_topk=4)
    assert decoder(num_query_groups=1) < decoder(num_query_groups=2) < decoder(num_query_groups=4)
    assert decoder(moe_shared_expert_intermediate_size=64) > decoder()


def test_padding_and_text_only_batches():
    cfg = _config()
    full = _work(cfg)
    half = _work(
        cfg,
        samples=4,
        images=4,
        real_tokens=2 * cfg.model.seq_length,
        real_attention_pairs=100,
        seq_length=cfg.model.seq_length,
    )
    assert half["decoder"].executed_forward == full["decoder"].executed_forward  # padding still runs
    assert half["decoder"].useful_forward < full["decoder"].useful_forward
    text_only = _work(
        cfg,
        samples=4,
        images=0,
        real_tokens=4 * cfg.model.seq_length,
        real_attention_pairs=4 * 80 * 81 // 2,
        seq_length=cfg.model.seq_length,
    )
    assert text_only["vision_encoder"].flops.hardware == text_only["projector"].flops.hardware == 0
    assert text_only["decoder"] == full["decoder"]


def test_flash_attention_executes_the_causal_triangle():
    cfg = _config()
    local = component_work(cfg, BatchTokens.unpadded(samples=2, images=2, seq_length=80), transformer_impl="local")
    flash = component_work(
        cfg, BatchTokens.unpadded(samples=2, images=2, seq_length=80), transformer_impl="transformer_engine"
    )
    assert flash["decoder"].executed_forward == flash["decoder"].useful_forward < local["decoder"].executed_forward


def test_mean_batch_is_linear():
    a = BatchTokens.from_lengths([10, 20], images=2, seq_length=20)
    b = BatchTokens.from_lengths([20, 20], images=2, seq_length=20)
    mean = BatchTokens.mean([a, b])
    cfg = dataclasses.replace(_config(), model=ModelConf(text_tokens=5))
    fa, fb, fm = (step_flops(cfg, x, transformer_impl="local")["total"].model for x in (a, b, mean))
    assert fm == pytest.approx((fa + fb) / 2, rel=1e-12)
    with pytest.raises(ValueError, match="seq_length=20"):
        BatchTokens.from_lengths([21], images=0, seq_length=20)
