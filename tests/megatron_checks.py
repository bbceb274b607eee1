"""megatron-core 0.19.2's own verdict on a plan, from the checks it makes before a model runs, on the CPU.

Run as a script (``python tests/megatron_checks.py PLANS.json VERDICTS.json``) in a process of its own: it
replaces ``torch.distributed``'s world with torch's fake backend (any world size in one process, no
communication) and applies the worker's CPU patches, neither of which a test process should keep. For each plan it
runs, for real:

- ``parallel_state.initialize_model_parallel`` over the plan's world (``RankGenerator`` arithmetic, every group);
- ``init_num_microbatches_calculator`` (global batch vs micro-batch x data-parallel size);
- the decoder's, the ViT's and the projector's ``TransformerConfig`` from the worker's own mapping
  (``model/build.py``: ``decoder_config``, ``vision_config``, ``projector_config``);
- ``get_num_layers_to_build`` for every pipeline rank and virtual stage (``transformer_block.py``);
- the token dispatcher's constructor the decoder's MoE layers build (``token_dispatcher.py``);
- the interleaved pipeline schedule (``schedules.py``) up to its first forward step, with stand-in model chunks;
- for plans on megatron's local specs, ``LLaVAModel``'s constructor checks (``llava_model.py``), through the
  worker's own ``build_model_chunks``, up to where LLaVA starts building its language model.

Stood in, because Transformer Engine, DeepEP and CUDA are absent on the CPU (see ``STOOD_IN``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

STOOD_IN = (
    "TE's fused kernels: TransformerConfig refuses moe_permute_fusion and apply_rope_fusion unless "
    "transformer_engine provides them; they are marked present, as on a GPU machine with TE (the worker's "
    "preflight requires transformer_engine for TE specs)",
    "DeepEP and HybridEP: the flex dispatcher's constructor makes its own checks, then its manager raises "
    "ImportError for the absent package; that ImportError counts as accepted (the preflight checks the package)",
    "process groups: torch's fake backend, so groups are created and sized as on the cluster but never communicate",
    "CUDA: the worker's CPU patches (train/cpu_compat.py) stand in for device placement in the dispatcher and the "
    "schedule; for GPU plans LLaVA's own TE attention check is restored (the CPU patches lift it)",
    "LLaVA on TE specs: TE's layer specs need transformer_engine, so LLaVA's constructor checks run for plans on "
    "local specs only",
)

LLAVA_SOURCE = "megatron/core/models/multimodal/llava_model.py"
"""The file whose checks ``_llava`` runs for plans on local specs."""


_UNPATCHED_LLAVA: tuple = (False, None)


class _FirstForwardStep(Exception):
    """Raised by the stand-in forward step: the schedule got past its checks."""


class _LanguageModelStarts(Exception):
    """Raised where LLaVA starts building its GPTModel: its constructor's checks have passed."""


@contextlib.contextmanager
def _te_fused_kernels_present() -> Iterator[None]:
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import moe_utils

    names = {
        moe_utils: (
            "fused_permute",
            "fused_permute_with_probs",
            "fused_sort_chunks_by_index",
            "fused_sort_chunks_by_index_with_probs",
            "fused_unpermute",
        ),
        rope_utils: ("fused_apply_rotary_pos_emb",),
    }
    saved = {(m, n): getattr(m, n) for m, ns in names.items() for n in ns}
    for module, name in saved:
        if getattr(module, name) is None:
            setattr(module, name, object())
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def _dispatcher(lm) -> None:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import token_dispatcher as td

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    ep = pgs.ep.size()
    if lm.num_moe_experts % ep:
        return  # the MoE layer refuses first (moe_layer.py); the rule table labels that a model-build check
    local = lm.num_moe_experts // ep
    indices = list(range(pgs.ep.rank() * local, (pgs.ep.rank() + 1) * local))
    cls = {
        "allgather": td.MoEAllGatherTokenDispatcher,
        "alltoall": td.MoEAlltoAllTokenDispatcher,
        "flex": td.MoEFlexTokenDispatcher,
    }[lm.moe_token_dispatcher_type]
    try:
        cls(local, indices, config=lm, pg_collection=pgs)
    except ImportError as exc:
        if "not installed" not in str(exc):
            raise


def _interleaved_schedule(lm, plan) -> None:
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving
    from megatron.core.transformer.enums import ModelType

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.model_type = lm, ModelType.encoder_or_decoder

        def set_input_tensor(self, tensor):
            pass

    def forward_step(*args, **kwargs):
        raise _FirstForwardStep

    cfg = plan.run_config
    with contextlib.suppress(_FirstForwardStep):
        forward_backward_pipelining_with_interleaving(
            forward_step_func=forward_step,
            data_iterator=[iter(())] * plan.layout.vpp,
            model=[Chunk() for _ in range(plan.layout.vpp)],
            num_microbatches=cfg.batch.gbs // (cfg.batch.mbs * parallel_state.get_data_parallel_world_size()),
            seq_length=plan.seq_length,
            micro_batch_size=cfg.batch.mbs,
        )


def _llava(plan, reached: dict) -> None:
    """LLaVA's constructor checks through the worker's own build, for plans on local specs."""
    from megatron.core.models.multimodal import llava_model

    from moe_vlm_sweep.model.build import build_model_chunks

    if plan.transformer_impl == "transformer_engine":
        return
    reached["llava"] = True

    def language_model(*args, **kwargs):
        raise _LanguageModelStarts

    saved = llava_model.HAVE_TE, llava_model.TEDotProductAttention, llava_model.GPTModel
    if plan.device == "cuda":  # undo cpu_compat's patch 11: on a GPU LLaVA's check stands
        llava_model.HAVE_TE, llava_model.TEDotProductAttention = _UNPATCHED_LLAVA
    llava_model.GPTModel = language_model
    try:
        build_model_chunks(plan)
    except _LanguageModelStarts:
        pass
    finally:
        llava_model.HAVE_TE, llava_model.TEDotProductAttention, llava_model.GPTModel = saved


def _check(plan, reached: dict) -> None:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from moe_vlm_sweep.model.build import decoder_config, projector_config, vision_config

    lay, cfg = plan.layout, plan.run_config
    parallel_state.initialize_model_parallel(
        **lay.megatron_sizes(),
        create_gloo_process_groups=False,
    )
    try:
        init_num_microbatches_calculator(
            0, None, cfg.batch.gbs, cfg.batch.mbs, parallel_state.get_data_parallel_world_size()
        )
        with _te_fused_kernels_present():
            lm = decoder_config(plan)
            vision_config(plan, lm)
            projector_config(plan, lm)
        for pp_rank in range(lay.pp):
            for vp_stage in range(lay.vpp) if lay.vpp > 1 else [None]:
                get_num_layers_to_build(lm, vp_stage=vp_stage, pp_rank=pp_rank)
        _dispatcher(lm)
        if lay.vpp > 1:
            _interleaved_schedule(lm, plan)
        with _te_fused_kernels_present():
            _llava(plan, reached)
    finally:
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()


def verdict(plan) -> dict:
    """``refused``: None if megatron-core accepts the plan, else its error as ``Type: message``; ``llava``: whether
    LLaVA's constructor checks were reached (they run last, and for plans on local specs only)."""
    reached = {"llava": False}
    try:
        _check(plan, reached)
        refused = None
    except (ValueError, AssertionError, RuntimeError, ZeroDivisionError) as exc:
        refused = f"{type(exc).__name__}: {exc}".strip()
    return {"refused": refused, **reached}


def main(argv: list[str]) -> int:
    import torch.distributed as dist
    from megatron.core.models.multimodal import llava_model
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moe_vlm_sweep.plan.plan import RunPlan
    from moe_vlm_sweep.train import cpu_compat

    global _UNPATCHED_LLAVA
    warnings.simplefilter("ignore")
    _UNPATCHED_LLAVA = llava_model.HAVE_TE, getattr(llava_model, "TEDotProductAttention", None)
    cpu_compat.apply()
    plans = [RunPlan.from_dict(d) for d in json.loads(Path(argv[0]).read_text())]
    by_world = defaultdict(list)
    for i, plan in enumerate(plans):
        by_world[plan.layout.world_size].append(i)
    verdicts: list[dict | None] = [None] * len(plans)
    for world, indices in sorted(by_world.items()):
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        try:
            for i in indices:
                verdicts[i] = verdict(plans[i])
        finally:
            dist.destroy_process_group()
    with open(argv[1], "w") as out:
        json.dump(verdicts, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
