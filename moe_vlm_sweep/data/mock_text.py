"""``mock_text``: random text ids and no images, like the mock datasets of LLM trainers. The misleading kind.

It fills the same decoder sequence as the multimodal run (``model.seq_length`` text ids), so the decoder shapes
match, but the vision encoder and projector never run and nothing is decoded from disk: a VLM benchmarked on
it looks much faster than on real input. Padding follows ``data.min_text_fraction`` (conf/data/mock_text.yaml
sets 1.0: mock loaders pack full sequences). Realism ``mock_text``: never ranked against image data.
"""

from __future__ import annotations

from moe_vlm_sweep.data.synthetic import SyntheticRows


class MockText(SyntheticRows):
    """The multimodal run's decoder sequence as text ids, with no images (``row_layout``)."""

    realism = "mock_text"
