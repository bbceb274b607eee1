"""In-batch packing (``data.packing``): the layout, the packed row through LLaVA, FLOPs and memory (its training
run is tests/test_training.py's, its rules tests/test_rules.py's cases).

On the CPU megatron's local attention keeps a packed row's samples apart with a block-causal mask; RoPE is
relative, so each sample scores as it does alone and the packed model computes the padded model's losses. TE's
THD attention does the same on the H200 (tests/test_gpu_graphs.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.config.schema import BatchConf, DataConf, ModelConf, ParallelConf, RunConfig, shortest_decoder_sample
from moe_vlm_sweep.data import make_source
from moe_vlm_sweep.data.batch import IMAGE_TOKEN_INDEX, Packed, pack
from moe_vlm_sweep.data.synthetic import SyntheticImages
from moe_vlm_sweep.model.flops import BatchTokens, component_work
from moe_vlm_sweep.plan.memory import estimate
from moe_vlm_sweep.plan.plan import make_plan

MODEL = ModelConf(text_tokens=65)
MBS = 3


def _padded():
    return SyntheticImages(MODEL, DataConf(), micro_batch_size=MBS).microbatch(0, 0)


def test_pack_runs_the_samples_back_to_back_without_padding():
    padded = _padded()
    packed = pack(padded)
    lengths = padded.text_lengths.tolist()
    assert padded.real_tokens < padded.padded_tokens  # the padded batch has padding to drop
    assert packed.input_ids.shape == (1, sum(lengths))
    assert packed.real_tokens == packed.padded_tokens == padded.real_tokens
    assert packed.loss_tokens == padded.loss_tokens
    assert torch.equal(packed.images, padded.images) and packed.images_per_sample == 1
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, *torch.cumsum(padded.decoder_lengths, 0).tolist()]
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    assert (packed.input_ids[0, starts] == IMAGE_TOKEN_INDEX).all()  # each sample opens with its image
    assert (packed.position_ids[0, starts] == 0).all()  # and counts its positions from 0
    for start, n, row in zip(starts.tolist(), lengths, range(MBS)):
        for name in ("input_ids", "labels", "loss_mask", "position_ids"):
            assert torch.equal(getattr(packed, name)[0, start : start + n], getattr(padded, name)[row, :n])
    with pytest.raises(ValueError, match="already packed"):
        pack(packed)


def test_packing_keeps_the_sources_realism():
    source = make_source(MODEL, DataConf(packing=True), micro_batch_size=MBS)
    assert isinstance(source, Packed) and source.realism == "synthetic_images"
    packed, padded = source.step(0, 1)[0], _padded()
    assert packed.packed and torch.equal(packed.input_ids, pack(padded).input_ids)


def test_a_packed_row_through_llava_gives_every_sample_its_padded_losses(megatron_world):
    from moe_vlm_sweep.model.build import build_model_chunks
    from moe_vlm_sweep.train.loop import packed_inputs

    cfg = RunConfig(
        model=MODEL,
        batch=BatchConf(mbs=MBS, gbs=MBS),
        parallel=ParallelConf(strategy="3d"),
        data=DataConf(packing=True),
    )
    plan = make_plan(cfg)
    assert plan.decoder_row_length == MBS * plan.seq_length  # LLaVA must not truncate the packed row
    torch.manual_seed(0)
    model = build_model_chunks(plan)[0].eval()
    padded = _padded()
    packed = pack(padded)
    assert packed_inputs(padded, plan.seq_length, "local") == {"attention_mask": None}
    with torch.no_grad():
        outputs = [
            model(
                images=mb.images,
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                labels=mb.labels,
                loss_mask=mb.loss_mask,
                **packed_inputs(mb, plan.seq_length, plan.transformer_impl),
            )
            for mb in (padded, packed)
        ]
    (padded_loss, padded_mask), (packed_loss, packed_mask) = outputs
    lengths = padded.decoder_lengths.tolist()
    assert packed_mask.shape == (1, packed.cu_seqlens[-1])
    assert packed_mask.sum() == padded_mask.sum() > 0
    # LLaVA puts each sample's labels and loss mask where the padded batch has them
    assert torch.equal(packed_mask[0], torch.cat([padded_mask[i, :n] for i, n in enumerate(lengths)]))
    counted = packed_mask[0].bool()
    expected = torch.cat([padded_loss[i, :n] for i, n in enumerate(lengths)])
    assert torch.allclose(packed_loss[0, counted], expected[counted], rtol=1e-4, atol=1e-5)
    unmasked = model(
        images=packed.images,
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        labels=packed.labels,
        loss_mask=packed.loss_mask,
        attention_mask=None,
    )[0]
    assert not torch.allclose(unmasked[0, counted], expected[counted], rtol=1e-3)  # the mask is what keeps them apart


def test_te_gets_the_rows_thd_boundaries_and_no_mask():
    from moe_vlm_sweep.train.loop import packed_inputs

    packed = pack(_padded())
    inputs = packed_inputs(packed, 1664, "transformer_engine")
    params = inputs["packed_seq_params"]
    assert inputs["attention_mask"] is None and params.qkv_format == "thd"
    assert params.cu_seqlens_q is packed.cu_seqlens and params.cu_seqlens_kv is packed.cu_seqlens
    assert (params.max_seqlen_q, params.max_seqlen_kv) == (1664, 1664)  # the plan's, the same every micro-batch
    assert packed_inputs(_padded(), 1664, "transformer_engine") == {"attention_mask": None}
    longest = int(packed.decoder_lengths.max())
    with pytest.raises(ValueError, match=f"a packed sample has {longest} decoder tokens"):
        packed_inputs(packed, longest - 1, "transformer_engine")  # RoPE's table would be too short


def test_block_causal_mask_hides_other_samples_and_later_tokens():
    packed = pack(
        SyntheticImages(
            ModelConf(text_tokens=8, vision=dataclasses.replace(MODEL.vision, image_size=8, patch_size=4)),
            DataConf(),
            micro_batch_size=2,
        ).microbatch(0, 0)
    )
    hidden = packed.block_causal_mask()[0, 0]
    cu = packed.cu_seqlens.tolist()
    for q in range(cu[-1]):
        start = max(c for c in cu[:-1] if c <= q)
        assert (~hidden[q]).nonzero().flatten().tolist() == list(range(start, q + 1))


def test_packed_flops_execute_the_real_tokens_only():
    lengths = [40, 90, 128]
    padded = BatchTokens.from_lengths(lengths, images=3, seq_length=128)
    packed = BatchTokens.from_lengths(lengths, images=3, seq_length=128, packed=True)
    assert packed.padded_tokens == packed.real_tokens == sum(lengths) < padded.padded_tokens
    assert packed.executed_attention_pairs("transformer_engine") == packed.real_attention_pairs
    cfg = RunConfig(model=MODEL)
    work = component_work(cfg, packed, transformer_impl="transformer_engine")["decoder"]
    assert work.executed_forward == work.useful_forward
    assert (
        component_work(cfg, padded, transformer_impl="transformer_engine")["decoder"].useful_forward
        == work.useful_forward
    )  # the same samples are the same useful work
    assert BatchTokens.mean([packed, packed]) == packed
    with pytest.raises(ValueError, match="packing"):
        BatchTokens.mean([packed, padded])


def _gpu(*overrides: str) -> RunConfig:
    return compose_run_config(
        ["model=small", "hardware=h200", "parallel=3d", "batch.mbs=32", "batch.gbs=32", *overrides]
    )


def test_packed_memory_counts_the_shortest_samples():
    padded, packed = _gpu(), _gpu("data.packing=true")
    short = shortest_decoder_sample(packed.model, packed.data)
    assert short == round(0.5 * 1024) + 575 < packed.model.seq_length  # model=small: min_text_fraction 0.5
    assert estimate(packed).total_gib < estimate(padded).total_gib
    assert estimate(packed).static_gib == estimate(padded).static_gib
    full = _gpu("data.packing=true", "data.min_text_fraction=1.0")  # samples that fill the row: nothing to drop
    assert estimate(full).total_gib == pytest.approx(estimate(padded).total_gib)
    assert shortest_decoder_sample(packed.model, dataclasses.replace(packed.data, name="webdataset")) == 1 * 576 + 2
