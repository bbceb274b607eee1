#!/bin/sh
# Best trial #1 of h200_small_fused-0d458fce.
moe-vlm-sweep run +experiment=h200_small_fused-0d458fce_best
# equivalently:
# moe-vlm-sweep run model=small model.text_tokens=1089 hardware=h200 launcher=local batch.gbs=192 fusions.bias_activation=true fusions.cross_entropy=false train.warmup_steps=3 train.steps=8 train.profile_steps=1 train.timeout_s=300 parallel=3d batch.mbs=96 recompute=none cuda_graph=attn_moe_router dispatcher=alltoall vision=trainable
