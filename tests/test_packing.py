"""In-batch packing (``data.packing``): the layout, LLaVA's handling of a packed row, FLOPs and memory (its rules
are tests/test_rules.py's cases).

On the CPU the local attention refuses THD, so the model test runs the packed row without its boundaries and
checks what does not depend on them: LLaVA places each sample's labels and loss mask where the padded batch has
them, and the first sample, which attends to itself only, gets the padded batch's losses wherever the loss
counts. The THD run
itself is tests/test_gpu_graphs.py's, on the H200.
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
            assert torch.equal(getattr(packed, name)[0, start:start + n], getattr(padded, name)[row, :n])
    with pytest.raises(ValueError, match="already packed"):
        pack(packed)


def test_packing_keeps_the_sources_realism():
    source = make_source(MODEL, DataConf(packing=True), micro_batch_size=MBS)
    assert isinstance(source, Packed) and source.realism == "synthetic_images"
    packed, padded = source.step(0, 1)[0], _padded()
    assert packed.packed and torch.equal(packed.input_ids, pack(padded).input_ids)


def test_llava_places_a_packed_rows_labels_and_loss_mask_per_sample(megatron_world):
    from moe_vlm_sweep.model.build import build_model_chunks

    cfg = RunConfig(model=MODEL, batch=BatchConf(mbs=MBS, gbs=MBS), parallel=ParallelConf(strategy="3d"))
    plan = make_plan(cfg)  # the rules refuse packing on the CPU: the packed model is built as the worker would
    packed_plan = dataclasses.replace(plan, config={**plan.config, "data": {**plan.config["data"], "packing": True}})
    assert packed_plan.decoder_row_length == MBS * plan.seq_length  # LLaVA must not truncate the packed row
    torch.manual_seed(0)
    model = build_model_chunks(packed_plan)[0].eval()
    padded = _padded()
    packed = pack(padded)
    with torch.no_grad():
        outputs = [model(images=mb.images, input_ids=mb.input_ids, position_ids=mb.position_ids,
                         attention_mask=None, labels=mb.labels, loss_mask=mb.loss_mask) for mb in (padded, packed)]
    (padded_loss, padded_mask), (packed_loss, packed_mask) = outputs
    cu = packed.cu_seqlens.tolist()
    lengths = padded.decoder_lengths.tolist()
    assert packed_mask.shape == (1, cu[-1])
    assert torch.equal(packed_mask[0], torch.cat([padded_mask[i, :n] for i, n in enumerate(lengths)]))
    assert packed_mask.sum() == padded_mask.sum() > 0
    first = slice(0, lengths[0])  # causal: the first sample sees only itself, packed or not
    assert torch.allclose(packed_loss[0, first] * packed_mask[0, first], padded_loss[0, first] * padded_mask[0, first],
                          rtol=1e-4, atol=1e-5)


def test_packed_flops_execute_the_real_tokens_only():
    lengths = [40, 90, 128]
    padded = BatchTokens.from_lengths(lengths, images=3, seq_length=128)
    packed = BatchTokens.from_lengths(lengths, images=3, seq_length=128, packed=True)
    assert packed.padded_tokens == packed.real_tokens == sum(lengths) < padded.padded_tokens
    assert packed.executed_attention_pairs("transformer_engine") == packed.real_attention_pairs
    cfg = RunConfig(model=MODEL)
    work = component_work(cfg, packed, transformer_impl="transformer_engine")["decoder"]
    assert work.executed_forward == work.useful_forward
    assert component_work(cfg, padded, transformer_impl="transformer_engine")["decoder"].useful_forward \
        == work.useful_forward  # the same samples are the same useful work
    assert BatchTokens.mean([packed, packed]) == packed
    with pytest.raises(ValueError, match="packing"):
        BatchTokens.mean([packed, padded])


def _gpu(*overrides: str) -> RunConfig:
    return compose_run_config(["model=small", "hardware=h200", "parallel=3d", "batch.mbs=32", "batch.gbs=32",
                               *overrides])


def test_packed_memory_counts_the_shortest_samples():
    padded, packed = _gpu(), _gpu("data.packing=true")
    short = shortest_decoder_sample(packed.model, packed.data)
    assert short == round(0.5 * 1024) + 575 < packed.model.seq_length  # model=small: min_text_fraction 0.5
    assert estimate(packed).total_gib < estimate(padded).total_gib
    assert estimate(packed).static_gib == estimate(padded).static_gib
    full = _gpu("data.packing=true", "data.min_text_fraction=1.0")  # samples that fill the row: nothing to drop
    assert estimate(full).total_gib == pytest.approx(estimate(padded).total_gib)
    assert shortest_decoder_sample(packed.model, dataclasses.replace(packed.data, name="webdataset")) == 1 * 576 + 2
