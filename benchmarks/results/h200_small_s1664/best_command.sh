#!/bin/sh
# Best trial #0 of h200_small_s1664-189b7026.
moe-vlm-sweep run +experiment=h200_small_s1664-189b7026_best
# equivalently:
# moe-vlm-sweep run model=small model.text_tokens=1089 hardware=h200 launcher=local batch.gbs=192 train.warmup_steps=3 train.steps=8 train.profile_steps=1 train.timeout_s=300 parallel=3d batch.mbs=64 recompute=none cuda_graph=none dispatcher=alltoall vision=trainable
