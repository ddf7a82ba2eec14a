"""What the training step asks of a model's attention cores: their kernel and platform set for
the devices the step is compiled for (:func:`configure`), the kernel each class runs and why
(:func:`kernels_of`, so that no fallback is silent), and the context layout they run over
(:func:`context_of`)."""

from __future__ import annotations

from flax import nnx

from jphantom.nn.attention.context import ContextPositions, RingAttention, context_kernel
from jphantom.nn.attention.core import CausalAttention
from jphantom.nn.attention.kernel_choice import check_implementation, choose


def configure(model: nnx.Module, implementation: str | None, platform: str) -> nnx.Module:
    """``model`` with every attention core's ``implementation`` (unless ``None``: as built) and
    ``platform`` set: the training step calls it on each rank's model as it traces the step, so
    the kernel is chosen for the devices the step is compiled for."""
    if implementation is not None:
        check_implementation(implementation)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (CausalAttention, RingAttention)):
            if implementation is not None:
                module.implementation = implementation
            module.platform = platform
    return model


def kernels_of(model: nnx.Module, implementation: str | None, platform: str, dtype,
               head_dim: int, *, packed: bool = False) -> dict[str, str]:
    """``{attention core class: "kernel (why)"}`` of ``model``'s cores on ``platform`` in
    ``dtype`` (``implementation``: the step's choice, ``None``: each core's own; ``packed``: for
    packed batches, with segment ids): what ``train`` prints and records, so that no fallback
    is silent. A core of the same class whose choice differs (a packed batch's sliding-window
    layers) is listed too, as ``"class (window W)"``."""
    out = {}
    for _, module in nnx.iter_modules(model):
        if not isinstance(module, (CausalAttention, RingAttention)):
            continue
        name = type(module).__name__
        chosen = implementation or module.implementation
        if isinstance(module, RingAttention):
            kernel, why = context_kernel(module.algorithm, chosen, platform, dtype, head_dim,
                                         packed=packed, window=module.window)
        else:
            kernel, why = choose(chosen, platform, dtype, head_dim, packed=packed,
                                 window=module.window)
        if name in out and out[name] != f"{kernel} ({why})":
            name = f"{name} (window {module.window})"
        out.setdefault(name, f"{kernel} ({why})")
    return out


def context_of(model: nnx.Module) -> tuple[int, bool] | None:
    """``(C, balanced)`` of a model whose attention runs over ``context``, else ``None``."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (RingAttention, ContextPositions)):
            return module.size, module.balanced
    return None
