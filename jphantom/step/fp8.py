"""FP8 GEMMs for Hopper and AMD Instinct: operands quantised to 8-bit floats with per-tensor
current scaling.

Micikevicius et al. 2022, "FP8 Formats for Deep Learning", defines the two formats; the recipe is
NVIDIA TransformerEngine's (and torchao's ``float8`` "tensorwise" scaling, which torchtitan
trains with): a GEMM's activation and weight in **E4M3** (3 mantissa bits, largest 448) in the
forward, the output's gradient in **E5M2** (2 mantissa bits, largest 57344: the range gradients
need) in the backward, so that

    forward   y  = x_q W_q                   (E4M3 x E4M3)
    backward  dx = dy_q W_q^T                (E5M2 x E4M3, "dgrad")
              dW = x_q^T dy_q                (E4M3 x E5M2, "wgrad")

each accumulated in float32 with its output in the compute dtype (bf16). A tensor x is quantised
with a scale computed from the tensor itself at every step (*current* scaling; TransformerEngine's
default is *delayed* scaling from an amax history, which saves the amax reduction but lags the
data): s = 2^ceil(log2(amax(|x|) / max_format)), the power of two at or above amax / max_format
(torchao's ``round_scales_to_power_of_2``; DeepSeek-V3's and the MX formats' scales are powers of
two too), x_q = round_format(x / s), dequantised as x_q s. Dividing by a power of two is exact,
and at most one binade of the format's range is left unused.

The GEMMs are written on the 8-bit operands themselves (:func:`matmul`, :func:`batched_matmul`,
and :func:`dot_general` for ``nnx.Linear``; a ``jax.custom_vjp`` whose backward quantises dy and
runs the dgrad and wgrad GEMMs on E5M2 x E4M3): ``lax.dot_general(x_q, W_q,
preferred_element_type=dtype) * (s_x s_W)``, the result in the compute dtype, which XLA:GPU's
GEMM rewriter turns into one cuBLAS-LT FP8 call (``__cublas$lt$matmul$f8``) taking the scales as
operands and writing bf16 from its float32 epilogue, on NVIDIA GPUs when Triton's GEMMs are off
(an FP8 run's ``gpu_defaults.FP8_XLA_FLAGS``; else XLA's Triton GEMM rewriter takes the FP8 dots
first). XLA:CPU widens the operands, accumulates in float32 and rounds the product to bf16 once;
times a power of two that is exact, so the CPU computes the once-rounded result the GPU's
epilogue does: the tests' emulation (``benchmarks/fp8_gemm_forms.py``: with arbitrary scales this
form rounds twice on CPU, and a float32 result costs the GPU a float32 write and a pass to bf16
per GEMM). The residuals kept for the
backward are x_q and W_q, one byte an element. Where a layer's GEMMs are its own (phantom's
hand-written backward, the dropless experts' ``lax.ragged_dot``) the operands are quantised and
dequantised around them instead (:func:`quantized`, :func:`quantized_gradient`): the same
numbers, on the compute dtype's tensor cores (an ``optimization_barrier`` keeps XLA from folding
the round trip away, as ``xla_allow_excess_precision`` otherwise does on GPUs). The straight-
through estimator carries gradients through the rounding (TransformerEngine's and torchao's).

**One scale per tensor, as on one device, across the axes that split a layer.** A tensor split
over the axes that cut one layer's tensors (``model``, ``context``, ``x``, ``y``: a weight's
columns, the sequence under sequence or context parallelism; ``expert``: the experts' weights and
the tokens sent to them, and the batch of the layers between) takes the maximum of its ranks'
amax (``lax.pmax`` over those axes), so every rank quantises with the scale the one-device model
would use: with float32 elsewhere, an FP8 step under tensor, sequence, context, expert or pmm3d
parallelism equals the one-device FP8 step (tested to 1e-5). The price is one all-reduce of a
scalar per quantised tensor per GEMM over those axes (TransformerEngine reduces amax over the
tensor-parallel group the same way). Over ``data`` and ``z`` (the batch alone) and ``stage`` the
scale stays the rank's own, as in every FP8 recipe: a data-parallel FP8 step equals the
one-device FP8 steps of its data ranks' batches, not one step of the whole batch, and no scalar
all-reduce crosses nodes with the data axis. With bf16 compute, a layout's sums round
differently (its partial sums are bf16 before their all-reduce), and FP8's coarse rounding
amplifies that: the FP8 step differs from the one-device FP8 step by up to 8x what the bf16
step differs by (docs/gpu.md gives the argument and the measurement).

**Two format families.** NVIDIA's Hopper/Blackwell and AMD's MI350 (gfx950) take the OCP formats
(``float8_e4m3fn``, largest 448; ``float8_e5m2``, 57344). AMD's MI300X/MI325X (gfx942) take only
the FNUZ variants (``float8_e4m3fnuz``, largest 240; ``float8_e5m2fnuz``, 57344: no negative zero,
one NaN, exponent bias one higher), as in MaxText's separate ``nanoo_fp8`` recipe; XLA's ROCm
compiler refuses OCP FP8 GEMMs there ("for gfx942 please use native supported fp8 variants").
The MI250X (gfx90a, CDNA2) has no FP8 GEMMs at all: ``fp8`` is refused there by name.
:func:`select` picks the family from the devices a run is built for (the mesh's; the target's in
an ahead-of-time compile), before anything is traced; the CPU emulates either exactly.

:class:`jphantom.step.precision.Precision` ``fp8`` (``--precision fp8``) sets this on the linear layers
of a model's :class:`~jphantom.nn.stack.Stacked` blocks (every linear layer of a model without
them): bf16 elsewhere (embeddings, norms, attention, the LM head and loss), float32 master weights
and optimizer state.
"""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jphantom.runtime import comm
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import DATA, STAGE, Z

E4M3 = jnp.float8_e4m3fn  # OCP, forward: activations and weights
E5M2 = jnp.float8_e5m2  # OCP, backward: output gradients
FAMILIES = {"ocp": (E4M3, E5M2), "fnuz": (jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)}
_active = ["ocp"]  # the family traced now (:func:`select`)
# the scale stays the rank's own over these: a pipeline stage's tensors are its own, and over the
# data axes each rank's activations are its own batch's (module docstring). ``expert`` is not
# among them: it splits the experts' tensors as well as the batch.
NO_SCALE_AXES = (STAGE, DATA, Z)


def family_of(device) -> str:
    """``ocp`` or ``fnuz``: the FP8 formats ``device``'s GEMMs take (module docstring); a
    :class:`ConfigError` for an AMD GPU without FP8 GEMMs (gfx90a: MI250X, MI210; older)."""
    platform = str(getattr(device, "platform", "cpu")).lower()
    kind = str(getattr(device, "device_kind", "")).lower()
    arch = str(getattr(device, "compute_capability", "") or "").lower()
    arch = arch if arch.startswith("gfx") else ""  # a target's device says "<unknown ...>"
    if not (platform == "rocm" or "gfx" in arch or "instinct" in kind or kind.startswith("mi")):
        return "ocp"  # CPU (exact emulation), NVIDIA, TPU
    if arch.startswith("gfx94") or any(m in kind for m in ("mi300", "mi325")):
        return "fnuz"
    if arch.startswith("gfx95") or any(m in kind for m in ("mi350", "mi355")):
        return "ocp"
    raise ConfigError(f"--precision fp8 on {device.device_kind}{f' ({arch})' if arch else ''}: "
                      "it has no FP8 GEMMs (CDNA2, gfx90a: MI250X, MI210; and older); use "
                      "--precision bf16, or an MI300X/MI325X (FNUZ formats) or MI350X/MI355X "
                      "(OCP)")


def select(devices) -> str:
    """Trace the FP8 GEMMs in the formats of ``devices`` (a run's mesh devices) from now on;
    returns the family. Raises :class:`ConfigError` before anything is traced where they have
    none, or where the devices disagree."""
    families = {family_of(d) for d in devices}
    if len(families) > 1:
        raise ConfigError(f"--precision fp8 on devices with different FP8 formats "
                          f"({', '.join(sorted(families))}): one format family per mesh")
    _active[0] = families.pop() if families else "ocp"
    return _active[0]


@contextlib.contextmanager
def using(family: str):
    """Trace FP8 GEMMs in ``family`` (``ocp``/``fnuz``) inside the block (the CPU emulates either:
    the tests'; a run's build calls :func:`select` for its devices instead)."""
    if family not in FAMILIES:
        raise ConfigError(f"FP8 format family {family!r}: use one of {', '.join(FAMILIES)}")
    previous, _active[0] = _active[0], family
    try:
        yield
    finally:
        _active[0] = previous


def formats() -> tuple:
    """(forward, backward) formats traced now: E4M3 and E5M2 of the selected family."""
    return FAMILIES[_active[0]]


def scale_of(x: jax.Array, fmt) -> jax.Array:
    """The per-tensor scale of ``x`` for ``fmt``: the power of two at or above amax(|x|) over the
    tensor (its ranks' shards along the axes that split a layer, module docstring) / the format's
    largest value, float32, never zero (:func:`power_of_two_at_least`)."""
    amax = jnp.max(jnp.abs(lax.stop_gradient(x))).astype(jnp.float32)
    axes = tuple(sorted(a for a in comm.varying_axes(x) if a not in NO_SCALE_AXES))
    if axes:
        amax = lax.pmax(amax, axes)  # all-reduce (max) of one scalar: the whole tensor's amax
    ratio = jnp.maximum(amax / float(jnp.finfo(fmt).max), jnp.finfo(jnp.float32).tiny)
    return power_of_two_at_least(ratio)


def power_of_two_at_least(v: jax.Array) -> jax.Array:
    """The least power of two >= ``v`` (float32, normal and finite), exactly: ``frexp``'s
    exponent (v = m 2^e, m in [0.5, 1)), one lower where v is a power of two itself."""
    mantissa, exponent = jnp.frexp(v)
    return jnp.ldexp(jnp.float32(1), exponent - (mantissa == 0.5))


def quantize(x: jax.Array, fmt) -> tuple[jax.Array, jax.Array]:
    """``(x_q, s)``: ``x`` in the 8-bit format ``fmt`` and its float32 scale (x ~ x_q s)."""
    scale = scale_of(x, fmt)
    return (x.astype(jnp.float32) / scale).astype(fmt), scale


def round_trip(x: jax.Array, fmt) -> jax.Array:
    """``x`` quantised to ``fmt`` and dequantised back to its dtype: the numbers an FP8 GEMM
    sees (the 8-bit value behind an ``optimization_barrier``, so that XLA keeps the rounding)."""
    q, scale = quantize(x, fmt)
    return lax.optimization_barrier(q).astype(x.dtype) * scale.astype(x.dtype)


@jax.custom_vjp
def quantized(x: jax.Array) -> jax.Array:
    """``x`` as an E4M3 forward operand (:func:`round_trip`); gradient straight through."""
    return round_trip(x, formats()[0])


quantized.defvjp(lambda x: (round_trip(x, formats()[0]), None), lambda _, g: (g,))


@jax.custom_vjp
def quantized_gradient(y: jax.Array) -> jax.Array:
    """The identity forward; its gradient quantised to E5M2: a GEMM output's, so that both
    backward GEMMs take it in FP8."""
    return y


quantized_gradient.defvjp(lambda y: (y, None), lambda _, g: (round_trip(g, formats()[1]),))


def _gemm(a8, b8, dims, scale, dtype):
    """An FP8 GEMM: float32 accumulation rounded once to ``dtype``, times the two scales' product
    (a power of two: exact; module docstring)."""
    return lax.dot_general(a8, b8, dims, preferred_element_type=dtype) * scale.astype(dtype)


# x [N, in] @ w [in, out]; batched: x [E, N, in] @ w [E, in, out] (the experts' GEMMs)
_DIMS = {False: ((((1,), (0,)), ((), ())),  # y = x w
                 (((1,), (1,)), ((), ())),  # dx = dy w^T
                 (((0,), (0,)), ((), ()))),  # dw = x^T dy
         True: ((((2,), (1,)), ((0,), (0,))),
                (((2,), (2,)), ((0,), (0,))),
                (((1,), (1,)), ((0,), (0,))))}


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_matmul(x, w, batched: bool):
    return _fp8_matmul_fwd(x, w, batched)[0]


def _fp8_matmul_fwd(x, w, batched):
    forward = formats()[0]
    x8, sx = quantize(x, forward)
    w8, sw = quantize(w, forward)
    return _gemm(x8, w8, _DIMS[batched][0], sx * sw, x.dtype), (x8, sx, w8, sw)


def _like(grad, primal):
    """``grad`` summed over the mesh axes it varies over and ``primal`` does not: the transpose
    of the implicit broadcast (``pvary``) that autodiff would have inserted for an operand
    replicated over an axis its GEMM's other operand is split over (pmm3d's x over ``y``)."""
    extra = comm.varying_axes(grad) - comm.varying_axes(primal)
    return comm.psum(grad, tuple(sorted(extra))) if extra else grad


def _fp8_matmul_bwd(batched, residuals, g):
    x8, sx, w8, sw = residuals
    g8, sg = quantize(g, formats()[1])
    _, dgrad, wgrad = _DIMS[batched]
    return (_like(_gemm(g8, w8, dgrad, sg * sw, g.dtype), x8),
            _like(_gemm(x8, g8, wgrad, sx * sg, g.dtype), w8))


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` (x [..., in], w [in, out]) as FP8 GEMMs forward and backward (module
    docstring), in the operands' common dtype."""
    dtype = jnp.result_type(x, w)
    rows = x.astype(dtype).reshape(-1, x.shape[-1])
    return _fp8_matmul(rows, w.astype(dtype), False).reshape(*x.shape[:-1], w.shape[-1])


def batched_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum("enh,ehf->enf", x, w)``: E independent FP8 GEMMs (a mixture's experts)."""
    dtype = jnp.result_type(x, w)
    return _fp8_matmul(x.astype(dtype), w.astype(dtype), True)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                **options):
    """A drop-in ``dot_general`` (``nnx.Linear``'s): the FP8 GEMMs of :func:`matmul` for a
    contraction of ``lhs``'s last dimension with a 2-D ``rhs``'s first; any other contraction on
    FP8-rounded operands (:func:`quantized`) in the compute dtype."""
    (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers
    if (tuple(contract_l) == (lhs.ndim - 1,) and tuple(contract_r) == (0,) and rhs.ndim == 2
            and not batch_l and not batch_r):
        out = matmul(lhs, rhs)
        return out if preferred_element_type is None else out.astype(preferred_element_type)
    out = lax.dot_general(quantized(lhs), quantized(rhs), dimension_numbers, precision=precision,
                          preferred_element_type=preferred_element_type, **options)
    return quantized_gradient(out)


__all__ = ["E4M3", "E5M2", "FAMILIES", "batched_matmul", "dot_general", "family_of", "formats",
           "matmul", "power_of_two_at_least", "quantized", "quantized_gradient", "quantize",
           "round_trip", "scale_of", "select", "using"]
