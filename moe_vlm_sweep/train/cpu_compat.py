"""What megatron-core 0.19.2 needs to train on the CPU with gloo: every patch in one place, each with its reason.

Applied only when ``plan.device == "cpu"`` (the worker calls :func:`apply` before it builds anything). The patches
are narrow: megatron modules that use ``torch.cuda`` as a device get a ``torch`` whose ``cuda`` namespace is
CPU-backed (their global name ``torch`` is rebound; torch itself is untouched), and the few places that check
CUDA-only tensor properties are wrapped. Nothing here changes what is computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
import types

import torch
from torch.distributed import DeviceMesh

from moe_vlm_sweep.model.local_norm import use_torch_norm_in_clip

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "as_tensor",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
)
# Megatron modules that use torch.cuda.current_device() as a device, literal device="cuda", CUDA streams, events,
# synchronize or the CUDA RNG; each gets the CPU-backed torch below (patches 2, 5, 6, 7).
_CUDA_AS_DEVICE_MODULES = (
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.utils",
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.multimodal.llava_model",
    "megatron.core.utils",
)

_applied = False


class _NoStream:
    """Stands in for torch.cuda.Stream and Event: on the CPU all work is already in order."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: self if name == "record_event" else None

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    __hash__ = object.__hash__

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` for the CPU: the calls megatron makes, the rest forwarded (and failing loudly if used)."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _cpu_cuda_namespace() -> _CpuCuda:
    rng = torch.Generator()  # the "CUDA" RNG megatron forks; CPU kernels draw from torch's default generator
    ns = _CpuCuda(
        current_device=lambda: torch.device("cpu"),
        device_count=lambda: 0,
        is_available=lambda: False,
        synchronize=lambda *a, **k: None,
        Stream=_NoStream,
        Event=_NoStream,
        current_stream=lambda *a, **k: _NoStream(),
        default_stream=lambda *a, **k: _NoStream(),
        stream=lambda *a, **k: contextlib.nullcontext(),
        get_rng_state=lambda *a, **k: rng.get_state(),
        set_rng_state=lambda state, *a, **k: rng.set_state(state),
        manual_seed=lambda seed: rng.manual_seed(seed),
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None),
    )
    ns.random = types.SimpleNamespace(get_rng_state=ns.get_rng_state)
    return ns


class _CpuDeviceType(type):
    """``torch.device`` that maps any CUDA device to the CPU (``f"cuda:{current_device()}"`` included) and still
    answers ``isinstance(x, torch.device)``."""

    def __call__(cls, *args, **kwargs):
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.device)


class _CpuDevice(metaclass=_CpuDeviceType):
    pass


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by one megatron module on the CPU: ``device="cuda"`` means the CPU, ``torch.cuda`` is
    CPU-backed; everything else is torch itself."""

    def __init__(self, cuda: _CpuCuda):
        super().__init__("torch")
        self.cuda, self.device = cuda, _CpuDevice
        for name in _FACTORIES:
            setattr(self, name, self._on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _on_cpu(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            if "device" in kwargs and kwargs["device"] is not None:
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make


@contextlib.contextmanager
def _cuda_type_names():
    """Make ``Tensor.type()`` report CUDA names while megatron checks ``== 'torch.cuda.FloatTensor'``."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        return _CUDA_TYPE_NAMES.get(name, name) if not args and not kwargs else name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _wrap(owner, name, around):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        with around():
            return original(*args, **kwargs)

    setattr(owner, name, wrapped)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _stub_paged_stash_kernels() -> None:
    """Patch 1: ``moe/ops/paged_stash.py`` imports triton at import time; its kernels are never used here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        stub = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
        vars(stub).update(GLOBAL_BLOCK_SIZE=1024, paged_stash_copy_kernel=None, paged_stash_pop_kernel=None)
        sys.modules[stub.__name__] = stub


def apply() -> None:
    """Install every CPU patch (idempotent). Call before megatron builds a model."""
    global _applied
    if _applied:
        return
    _stub_paged_stash_kernels()
    cpu_torch = _CpuTorch(_cpu_cuda_namespace())
    for name in _CUDA_AS_DEVICE_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            vars(module)["torch"] = cpu_torch

    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buffer
    from megatron.core.models.multimodal import llava_model
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.optimizer import distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe import token_dispatcher

    # Patch 2: the RNG tracker reads and writes the CUDA generator's state; keep its states on a CPU generator.
    random._get_cuda_rng_state = lambda *a, **k: cpu_torch.cuda.get_rng_state()
    random._set_cuda_rng_state = lambda state, *a, **k: cpu_torch.cuda.set_rng_state(state)
    # Patch 3: CLIPViTModel's default norm needs TE; without it, WrappedTorchNorm (model/local_norm.py).
    use_torch_norm_in_clip()
    # Patch 4: CLIPViTModel moves its position ids with a bare ``.cuda()`` in the constructor.
    _wrap(CLIPViTModel, "__init__", _tensor_cuda_is_identity)
    # Patch 8: the optimizers accept only parameters whose type() is a torch.cuda.* tensor type.
    _wrap(distrib_optimizer.DistributedOptimizer, "__init__", _cuda_type_names)
    _wrap(optimizer.Float16OptimizerWithFloat16Params, "__init__", _cuda_type_names)
    _wrap(optimizer, "clip_grad_by_total_norm_fp32", _cuda_type_names)
    _patch_checkpoint_without_output()
    # Patch 10: at EP > 1 alltoall's split sizes must become host lists, but the helper only converts CUDA tensors.
    original_move = token_dispatcher.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move
    # Patch 11: LLaVA asserts TE attention under sequence parallelism (for padding masks); the local causal
    # attention is exact here because the combined sequence is padded to a multiple of TP before sharding.
    llava_model.HAVE_TE, llava_model.TEDotProductAttention = True, DotProductAttention
    # Patch 12: the Megatron-FSDP adapter builds its DeviceMesh with device_type="cuda" (DTensors then move there).
    mcore_fsdp_adapter.DeviceMesh = types.SimpleNamespace(
        from_group=lambda *a, **k: DeviceMesh.from_group(*a, **{**k, "device_type": "cpu"})
    )
    # Patch 13: Megatron-FSDP validates its DTensor shards with a bare ``.cuda()``.
    _wrap(fsdp_buffer, "validate_uneven_dtensor", _tensor_cuda_is_identity)
    _sequence_parallel_torch_norm()
    _applied = True


def _patch_checkpoint_without_output() -> None:
    """Patch 9: CheckpointWithoutOutput (layernorm/moe_act recompute) sets ``self.fp8 = fp8 is not None``, so fp8
    is always on, and its fp8 path needs TE (NameError without it)."""
    from megatron.core.tensor_parallel import random

    original = random.CheckpointWithoutOutput.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.fp8 = False

    random.CheckpointWithoutOutput.__init__ = init


def _sequence_parallel_torch_norm() -> None:
    """Patch 14: without TE or Apex the norm is WrappedTorchNorm, which refuses sequence parallelism. Megatron's
    own SP norms only differ by marking their weights ``sequence_parallel`` so that finalize_model_grads
    all-reduces their gradients over TP; do exactly that."""
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        norm = original(cls, dataclasses.replace(config, sequence_parallel=False), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new
