"""``mock_text``: random text ids and no images, like the mock datasets of LLM trainers. The misleading kind.

It fills the same decoder sequence as the multimodal run (``model.seq_length`` text ids), so the decoder shapes
match, but the vision encoder and projector never run and nothing is decoded from disk: a VLM benchmarked on
it looks much faster than on real input. Padding follows ``data.min_text_fraction`` (conf/data/mock_text.yaml
sets 1.0: mock loaders pack full sequences). Realism ``mock_text``: never ranked against image data.
"""

from __future__ import annotations

from moe_vlm_sweep.config.schema import DataConf, ModelConf, row_layout
from moe_vlm_sweep.data.synthetic import SyntheticRows


class MockText(SyntheticRows):
    realism = "mock_text"

    def __init__(self, model: ModelConf, data: DataConf, *, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        images, row = row_layout(model, data)
        super().__init__(
            model,
            data,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            images_per_sample=images,
            row_length=row,
        )
