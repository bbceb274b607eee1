#!/bin/sh
# Best trial #1 of h200_proxy-afbde3bd.
moe-vlm-sweep run +experiment=h200_proxy-afbde3bd_best
# equivalently:
# moe-vlm-sweep run model=qwen3_vl_30b_a3b_proxy hardware=h200 launcher=local batch.gbs=8 train.warmup_steps=3 train.steps=6 train.profile_steps=1 train.timeout_s=300 parallel=3d batch.mbs=4 recompute=none cuda_graph=none dispatcher=alltoall vision=trainable
