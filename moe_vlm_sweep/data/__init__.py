"""Data sources for the training worker; each declares its ``realism`` (runs of different realism never rank together)."""

from moe_vlm_sweep.data.synthetic import IMAGE_TOKEN_INDEX, MicroBatch, SyntheticImages

__all__ = ["IMAGE_TOKEN_INDEX", "MicroBatch", "SyntheticImages"]
