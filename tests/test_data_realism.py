"""Data realism: mock_text, synthetic_images and webdataset batches, effective tokens, real images through the CLI.

The webdataset shards are built from real photographs that scikit-image ships inside its wheel (the encoded
PNG/JPEG files themselves, no network), with captions.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import ok_run
from PIL import Image

from moe_vlm_sweep.config.schema import ConfigFieldError, DataConf, ModelConf, RunConfig
from moe_vlm_sweep.data import MockText, SyntheticImages, make_source
from moe_vlm_sweep.data.batch import IMAGE_TOKEN_INDEX, PAD_TOKEN_ID, layout
from moe_vlm_sweep.model.flops import BatchTokens
from moe_vlm_sweep.plan.plan import RunPlan, make_plan

MODEL = ModelConf(text_tokens=65)
CAPTIONS = {
    "astronaut.png": "An astronaut in a white suit poses before the American flag.",
    "coffee.png": "A cup of coffee on a saucer, seen from above.",
    "chelsea.png": "A tabby cat named Chelsea looks to the side.",
    "rocket.jpg": "A rocket on the launch pad under a clear sky.",
    "camera.png": "A man with a camera on a tripod, in black and white.",
    "coins.png": "Old coins lying on a dark background.",
    "hubble_deep_field.jpg": "Thousands of galaxies in the Hubble deep field.",
    "moon.png": "The surface of the moon, grey and cratered.",
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """Three .tar shards of (image file, caption) records; returns a glob over them."""
    import skimage.data

    from moe_vlm_sweep.data.webdataset_shards import write_shards

    images = Path(skimage.data.__file__).parent
    records = [
        (f"{i:04d}", (images / name).read_bytes(), name.rsplit(".", 1)[1], caption)
        for i, (name, caption) in enumerate(CAPTIONS.items())
    ]
    out = tmp_path_factory.mktemp("shards")
    written = write_shards(records, str(out / "shard-%06d.tar"), per_shard=3)
    assert len(written) == 3
    return str(out / "shard-*.tar")


def test_mock_text_has_no_images_and_fills_the_decoder_sequence():
    source = make_source(
        MODEL, DataConf(name="mock_text", realism="mock_text", min_text_fraction=1.0), micro_batch_size=4
    )
    assert isinstance(source, MockText) and source.realism == "mock_text"
    mb = source.step(0, 1)[0]
    assert mb.images.shape[0] == 0 and (mb.input_ids != IMAGE_TOKEN_INDEX).all()
    assert mb.input_ids.shape == (4, MODEL.seq_length)  # the decoder shapes of the multimodal run
    assert mb.real_tokens == mb.padded_tokens == 4 * MODEL.seq_length


def test_synthetic_images_have_images_and_real_padding():
    source = make_source(MODEL, DataConf(), micro_batch_size=4)
    assert isinstance(source, SyntheticImages) and source.realism == "synthetic_images"
    mb = source.step(0, 1)[0]
    assert mb.images.shape == (4, 3, 56, 56)
    assert mb.real_tokens < mb.padded_tokens and len(set(mb.text_lengths.tolist())) > 1


def _pixels(name: str, size: int) -> torch.Tensor:
    import skimage.data

    from moe_vlm_sweep.data.webdataset_shards import to_pixels

    return to_pixels(Image.open(Path(skimage.data.__file__).parent / name), size)


def test_webdataset_batches_are_the_real_images_and_captions(shards):
    data = DataConf(name="webdataset", realism="real_images", shards=shards)
    source = make_source(MODEL, data, micro_batch_size=2)
    assert source.realism == "real_images"
    first, second = source.step(0, 2)
    names = list(CAPTIONS)
    assert torch.equal(first.images[0], _pixels(names[0], 56)) and torch.equal(second.images[1], _pixels(names[3], 56))
    assert first.images.shape == (2, 3, 56, 56) and 0.0 <= float(first.images.min()) < float(first.images.max()) <= 1.0
    caption = CAPTIONS[names[0]].encode()
    assert first.text_lengths[0] == 1 + min(len(caption), MODEL.text_tokens - 1)
    assert first.input_ids[0, 0] == IMAGE_TOKEN_INDEX
    assert first.input_ids[0, 1] == 1 + caption[0] % (MODEL.decoder.vocab_size - 1)
    assert first.real_tokens < first.padded_tokens  # captions are shorter than the text budget: real padding
    # Data-parallel rank 1 of 2 reads the odd records; the shards repeat endlessly.
    other = make_source(MODEL, data, micro_batch_size=2, dp_rank=1, dp_size=2)
    assert torch.equal(other.step(0, 1)[0].images[0], _pixels(names[1], 56))
    assert len(source.step(1, 4)) == 4  # 8 records, 12 read: wrapped around


def test_realism_is_the_sources_own_and_shards_must_exist(tmp_path):
    with pytest.raises(ConfigFieldError, match=re.escape("data.realism='synthetic_images' must be 'mock_text'")):
        make_source(MODEL, DataConf(name="mock_text", realism="synthetic_images"), micro_batch_size=1)
    with pytest.raises(ConfigFieldError, match=re.escape("data.shards must name")):
        make_source(MODEL, DataConf(name="webdataset", realism="real_images"), micro_batch_size=1)
    with pytest.raises(ConfigFieldError, match="matches no file"):
        make_source(
            MODEL,
            DataConf(name="webdataset", realism="real_images", shards=str(tmp_path / "*.tar")),
            micro_batch_size=1,
        )


def test_effective_tokens_are_padded_tokens_times_real_over_padded():
    """A batch of known padding: 2 samples of 80 decoder tokens, real text 30 and 65 ids (+ 15 image tokens)."""
    from moe_vlm_sweep.train.loop import TrainResult
    from moe_vlm_sweep.train.worker import build_metrics

    mb = layout(
        torch.zeros(2, 3, 56, 56),
        [torch.arange(1, 30), torch.arange(1, 65)],
        images_per_sample=1,
        row_length=65,
        image_tokens=16,
    )
    assert mb.text_lengths.tolist() == [30, 65] and mb.padded_tokens == 160
    assert mb.real_tokens == 30 + 15 + 65 + 15 == 125
    assert (mb.input_ids[0, 30:] == PAD_TOKEN_ID).all()
    plan = make_plan(RunConfig(model=MODEL))
    batch = BatchTokens.from_lengths(mb.decoder_lengths.tolist(), images=2, seq_length=plan.seq_length)
    result = TrainResult(step_times=[0.5, 0.25, 1.0], losses=[1.0] * 3, phases=["measured"] * 3, batches=[batch] * 3)
    m = build_metrics(plan, result, (1.0, "measured_matmul"), (0.1, "peak_rss"))
    assert (m.real_tokens_per_step, m.padded_tokens_per_step) == (125, 160)
    assert m.tokens_per_s == 160 / 0.5
    assert m.effective_tokens_per_s == pytest.approx(m.tokens_per_s * 125 / 160, rel=1e-15)
    assert m.effective_tokens_per_s_per_gpu == pytest.approx(m.tokens_per_s_per_gpu * 125 / 160, rel=1e-15)
    assert m.mfu < m.hfu  # padding and the masked attention half run but are not useful


def test_webdataset_trains_from_real_image_files(run_cli, shards):
    run_dir, metrics = ok_run(
        run_cli(
            "model=tiny",
            "data=webdataset",
            f"data.shards='{shards}'",
            "train.warmup_steps=1",
            "train.steps=2",
            "train.profile_steps=1",
        )
    )
    assert metrics["data_realism"] == "real_images"
    assert all(v == v for v in metrics["loss"]["values"])
    assert metrics["effective_tokens_per_s"] < metrics["tokens_per_s"]
    assert metrics["flops_per_step"]["vision_encoder"]["model"] > 0
    # The token count is what it says it is: each caption's UTF-8 bytes (no tokenizer) plus the image tokens.
    assert any("UTF-8 bytes" in note and "real_tokens_per_step" in note for note in metrics["accounting_notes"])
    plan = RunPlan.read(run_dir / "plan.json")
    cfg = plan.run_config
    source = make_source(cfg.model, cfg.data, micro_batch_size=cfg.batch.mbs)
    steps = [source.step(step, plan.num_microbatches) for step in range(3)]  # one warm-up step, two measured
    assert metrics["real_tokens_per_step"] == sum(sum(mb.real_tokens for mb in step) for step in steps[1:]) / 2
    first_caption = next(iter(CAPTIONS.values()))
    assert steps[0][0].text_lengths[0] == 1 + len(first_caption.encode())  # its image placeholder, then its bytes
    # Decoding runs outside the timed step; the wait for it is recorded per measured step, inside the wall time.
    waits = metrics["data_wait_s"]
    assert len(waits) == 2 and all(w > 0 for w in waits)
    assert metrics["wall_s"]["measured"] >= sum(metrics["step_time_s"]["steps"]) + sum(waits)


def test_mock_text_run_reports_no_vision_work(run_cli):
    _, metrics = ok_run(
        run_cli("model=tiny", "data=mock_text", "train.warmup_steps=1", "train.steps=2", "train.profile_steps=1")
    )
    assert metrics["data_realism"] == "mock_text"
    assert metrics["effective_tokens_per_s"] == metrics["tokens_per_s"]  # mock text has no padding
    assert metrics["flops_per_step"]["vision_encoder"] == {"model": 0.0, "hardware": 0.0}
    split = metrics["component_split"]["seconds"]
    assert split["vision_encoder.forward"] == split["vision_encoder.backward"] == 0.0
