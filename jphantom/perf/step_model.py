"""Analytic per-rank model of one training step: FLOPs, collectives, memory and modelled time.

For Seal et al.'s FFN (L layers of n x n, batch B, features sharded over p ranks) under

- ``"tensor-t1"``: Seal et al.'s TP, :class:`jphantom.nn.tensor.T1Linear` (row-sharded
  W^(j) [n/p, n]; all-gather the [B, n/p] activations forward, reduce-scatter [B, n] -> [B, n/p]
  backward), or
- ``"phantom"``: :mod:`jphantom.nn.phantom.ops` (local L [n/p, n/p], compressor C [k, n/p],
  decompressors D [p, n/p, k]; all-gather of k B forward, reduce-scatter to k B backward), with the
  fused decompressor (one GEMM, the default) or the paper's p-1 small GEMMs (``fused=False``),

this module gives, per rank (per device) and per step (forward + backward + optimizer update), for
any n, L, p, k, B, including sizes too large to run here (Seal et al. Fig. 6: n = 131072 and 262144,
p = 32..256):

===========================  ===========  ============================================================
quantity                     label        source
===========================  ===========  ============================================================
GEMM FLOPs, GEMM count       exact        the code's matrix products, counted below (2 FLOPs per
                                          multiply-add); equal to the ``dot`` ops of the compiled HLO
collectives (kind/count/     exact        the strategy's own inventory,
bytes)                                    ``inventory.collective_inventory`` (verified
                                          against HLO in tests/compile/test_hlo.py) + the scalar loss
                                          all-reduce
parameter, gradient,         exact        sizes of the arrays the code allocates per rank
optimizer-state, batch bytes
saved activations,           modelled     the rule in :func:`step_memory` (which residuals live from
workspace, peak memory                    the forward to the backward); XLA's actual peak differs
compute, comm, overhead,     modelled     FLOPs / (peak x efficiency); Eq. 26 with Table III; a per-GEMM
total seconds                             overhead for the unfused decompressor
===========================  ===========  ============================================================

FLOPs per rank per step, m = n/p (every GEMM of the code). The first layer's input gradient is dead
code, its only use would be dL/dx: every strategy applies layer 1 outside the ``lax.scan`` over the
other layers (:class:`jphantom.nn.Stacked` with ``peel_first``), so XLA removes it (as it removes T1's first
reduce-scatter):

    tensor-t1, per layer:     forward  y_full W^T               2 B n m
                              backward dW = dz^T y_full          2 B n m
                                       dy_full = dz W            2 B n m      (layers 2..L)
        total = 2 B n m (3L - 1)           GEMMs: 3L - 1

    phantom, fused, per layer:
        forward   g = y C^T  2 B m k;  y L^T  2 B m^2;  [B, p k] x [p k, m]  2 B p k m   (3 GEMMs)
        backward  messages dz D_all      2 B m p k                            (Eq. 17)
                  [dz | Gamma]^T [y | G] 2 B (m + k)(m + p k)                 (Eqs. 19-21 in one GEMM;
                                                 the k x p k corner Gamma^T G, 2 B k p k, is waste)
                  dy = dz L + Gamma C    2 B m^2 + 2 B k m          (layers 2..L; all L if L >= 2)
        The fused GEMMs run over all p slots (own slot masked to zero): p, not p - 1, decompressors.

    phantom, unfused (the paper's implementation), per layer:
        forward   2 B m k + 2 B m^2 + (p-1) 2 B k m              (2 + (p-1) GEMMs)
        backward  messages (p-1) 2 B m k;  dD (p-1) 2 B m k;  dL 2 B m^2;  dC 2 B k m;
                  dy 2 B m^2 + 2 B k m (as fused)               (2(p-1) + 2 + 2 GEMMs)
        = 3 x forward (the paper's Eqs. 22-24: backward = 2 x forward), less the first layer's dy
        at L = 1;
        3 (p-1) L of its GEMMs are the small [B, k] x [k, m]-shaped decompressor products.

Memory per rank (``dtype`` bytes per element; ``optimizer_states`` per-parameter moments, 0 SGD,
1 momentum, 2 Adam):

    parameters   tensor-t1: L (m n + m)         phantom: L (m^2 + k m + p m k + m)
                 (phantom stores D as [p, m, k] per rank, *including* the unused own slot D^(j,j):
                 m k per layer more than the paper's (p-1) decompressors)
    gradients    = parameters (same shapes)
    optimizer    = optimizer_states x parameters (scalar step counters, e.g. Adam's, not counted)
    batch        input x and target y, 2 B m
    activations  (modelled rule) for every layer, the arrays its weight-gradient GEMMs read, which must
                 live from the forward to the backward:
                   tensor-t1       the all-gathered input [B, n]  (layer 1 too: x gathered is new)
                   phantom fused   [B, m + p k]  (y and the received ghosts side by side, a copy)
                   phantom unfused y [B, m] (layers 2..L; layer 1 reads the input batch) and the
                                   gathered ghosts [p, B, k]
                 plus one [B, m] pre-activation per hidden layer (the ReLU derivative) and the
                 [B, m] residual of the MSE.
    workspace    (modelled) phantom fused keeps the masked decompressor matrix [m, p k] of every layer
                 from the forward to the backward (XLA computes it once per step); others 0. Other
                 transient buffers (e.g. T1's [B, n] input gradient before its reduce-scatter) and
                 allocator overheads are not modelled.
    peak         parameters + gradients + optimizer + batch + activations + workspace: the usual
                 "model states + activations" accounting of a framework that materialises all
                 gradients before the update (PyTorch). XLA can fuse each update into its gradient
                 and need less; frameworks with extra temporaries (e.g. a foreach Adam) need more.

Time per step (modelled; no overlap of computation with communication, as Eq. 1 splits them):

    compute_s  = FLOPs / (device.peak_flops x device.efficiency)
    comm_s     = Eq. 26 summed over the step's collectives (``CommModel.step_time_us``; default
                 ``comm_model.FRONTIER``, Seal et al. Table III), all among the p ranks
    overhead_s = 3 (p-1) L x gemm_overhead_s for phantom with ``fused=False`` (the p-1 small
                 decompressor GEMMs per pass that the paper blames for Fig. 6's p = 256 slowdown;
                 a kernel launch on a GPU), else 0: the O(L) large GEMMs' launches are not modelled
                 for any strategy (a few L x 10 us)
    total_s    = compute_s + comm_s + overhead_s
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from jphantom.registry import strategies
from jphantom.errors import ConfigError, check_int, check_real, JPhantomWarning
from jphantom.perf.comm_model import FRONTIER, CommModel
from jphantom.nn.phantom import ops as phantom
from jphantom.nn.shapes import check_depth, check_width

STRATEGIES = tuple(name for name, row in strategies.STRATEGIES.items()
                   if row.declares("step_model") and row.fused)
"""Strategies with a step model (their registry rows name one,
:attr:`jphantom.registry.strategies.Strategy.step_model`): Seal et al.'s TP (``tensor-t1``, :data:`T1`) and
phantom (:data:`PHANTOM`; ``fused`` picks ``phantom`` or ``phantom-unfused``). Megatron's
``tensor`` and ``gspmd`` have none (their FLOPs are not modelled)."""
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}
"""Per-parameter state arrays of common optax optimizers (plain SGD, SGD with momentum, Adam)."""

GIB = 2**30


# --------------------------------------------------------------------------------------------------
# Device assumptions
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """What one rank's device is assumed to deliver (all of it is an assumption, not a measurement).

    ``peak_flops`` [FLOP/s] in the step's dtype, ``efficiency`` the fraction of it the step's GEMMs
    reach (0 < efficiency <= 1), ``memory_bytes`` the device memory, ``source`` where the numbers
    come from.
    """

    name: str
    peak_flops: float
    efficiency: float
    memory_bytes: int
    source: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"DeviceSpec.name={self.name!r} must be a non-empty string")
        object.__setattr__(self, "peak_flops", check_real(
            "DeviceSpec.peak_flops", self.peak_flops, low=0.0, low_inclusive=False,
            fix="give the device's peak FLOP/s in the step's dtype, e.g. 47.9e12"))
        object.__setattr__(self, "efficiency", check_real(
            "DeviceSpec.efficiency", self.efficiency, low=0.0, high=1.0, low_inclusive=False,
            fix="give the fraction of peak the GEMMs reach, e.g. 0.5"))
        check_int("DeviceSpec.memory_bytes", self.memory_bytes, 1,
                     "give the device memory in bytes, e.g. 64 * 2**30")

    @property
    def flops_per_second(self) -> float:
        """The modelled sustained rate, peak x efficiency."""
        return self.peak_flops * self.efficiency

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"sustained_flops": self.flops_per_second}


MI250X_GCD = DeviceSpec(
    name="AMD Instinct MI250X, one GCD (Frontier)",
    # 110 CUs per GCD x 256 FP32 FLOP/clock/CU on the matrix cores (MFMA) x 1.7 GHz peak engine
    # clock = 47.87 TFLOP/s (AMD's MI250X datasheet: 95.7 TFLOP/s FP32 matrix for the 2-GCD package,
    # 47.9 FP32 vector; FLOP/clock/CU from AMD's GPUOpen lab note "AMD matrix cores").
    peak_flops=110 * 256 * 1.7e9,
    efficiency=0.5,
    memory_bytes=64 * GIB,
    source=(
        "peak: FP32 *matrix* (MFMA) peak of one GCD, 110 CU x 256 FLOP/clk/CU x 1.7 GHz = 47.9 "
        "TFLOP/s (AMD MI250X datasheet, 95.7 TFLOP/s FP32 matrix per 2-GCD package; GPUOpen 'AMD "
        "matrix cores' lab note); chosen over the 23.9 TFLOP/s vector peak because rocBLAS/"
        "hipBLASLt FP32 GEMMs (PyTorch's fp32 matmul on ROCm) run on the matrix cores. efficiency "
        "0.5 is our assumption for the large GEMMs of this step, not a measurement (modelled "
        "compute time scales as 1/efficiency). memory: 64 GiB HBM2e per GCD (128 GB per MI250X, "
        "Seal et al. Sec. VI); usable memory is somewhat less (runtime, allocator)"
    ),
)
"""Frontier's device in Seal et al.: one Graphics Compute Die of an AMD MI250X."""


# --------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One training step to model; validated on construction (``ConfigError`` names the fix).

    ``strategy`` "tensor-t1" or "phantom"; ``width`` n, ``depth`` L, ``num_shards`` p, ``batch``
    B, ``ghost_width`` k (phantom only), ``fused`` (phantom's decompressor: one GEMM or the paper's
    p-1), ``dtype`` of parameters, activations and messages, ``optimizer_states`` per-parameter
    moments (see ``OPTIMIZER_STATES``), ``loss_allreduce``: count the scalar all-reduce of the MSE
    loss (the only other collective of jphantom's compiled step; ``tests/compile/test_hlo.py``).
    """

    strategy: str
    width: int
    depth: int
    num_shards: int
    batch: int
    ghost_width: int | None = None
    fused: bool = True
    dtype: str = "float32"
    optimizer_states: int = 0
    loss_allreduce: bool = True

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"strategy={self.strategy!r} has no step model; use one of {STRATEGIES} "
                "('tensor-t1' is Seal et al.'s TP, jphantom.nn.tensor.T1Linear; phantom's "
                "unfused decompressor is strategy='phantom', fused=False)"
            )
        check_int("width", self.width, 1, "it is n, the layer width")
        check_int("num_shards", self.num_shards, 1, "it is p, the number of ranks")
        check_width(self.width, self.num_shards)
        check_int("depth", self.depth, 1, "it is L, the number of n x n layers")
        check_depth(self.depth)
        check_int("batch", self.batch, 1, "it is B, the samples per step")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype={self.dtype!r} is not modelled; use one of {sorted(DTYPE_BYTES)}")
        check_int("optimizer_states", self.optimizer_states, 0,
                     f"per-parameter optimizer arrays, e.g. {OPTIMIZER_STATES}")
        if not isinstance(self.fused, bool) or not isinstance(self.loss_allreduce, bool):
            raise ConfigError(f"fused={self.fused!r} and loss_allreduce={self.loss_allreduce!r} "
                              "must be True or False")
        self.model.check(self)

    @property
    def model(self) -> "StrategyStepModel":
        """The step model of the strategy (its registry row's
        :attr:`~jphantom.registry.strategies.Strategy.step_model`: :data:`T1` or :data:`PHANTOM`)."""
        return strategies.get(self.strategy).step_model

    @property
    def block(self) -> int:
        """m = n/p, the features each rank owns."""
        return self.width // self.num_shards

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def strategy_name(self) -> str:
        """The registry name of the modelled step (:data:`jphantom.registry.strategies.STRATEGIES`): ``tensor-t1``,
        ``phantom`` or ``phantom-unfused``."""
        return next(name for name, row in strategies.STRATEGIES.items()
                    if row.declares("step_model") and row.step_model is self.model
                    and row.fused == self.fused)

    @property
    def label(self) -> str:
        return self.model.label(self)


class StrategyStepModel:
    """One strategy's step (module docstring): what it checks of a :class:`StepShape` and its
    formulas, per rank. A strategy's registry row names its instance
    (:attr:`jphantom.registry.strategies.Strategy.step_model`)."""

    def check(self, shape: StepShape) -> None:
        """The shape's strategy-specific fields, refused by name (ConfigError)."""
        if shape.ghost_width is not None:
            raise ConfigError(f"ghost_width={shape.ghost_width} is only for strategy='phantom'; "
                              f"leave it None for {shape.strategy!r}")
        if not shape.fused:
            raise ConfigError("fused=False is phantom's unfused decompressor; leave fused=True "
                              f"for strategy={shape.strategy!r}")

    def label(self, shape: StepShape) -> str:
        raise NotImplementedError

    def flops(self, shape: StepShape) -> dict:
        """:func:`step_flops`."""
        raise NotImplementedError

    def parameter_elements(self, shape: StepShape) -> int:
        """:func:`parameter_elements`."""
        raise NotImplementedError

    def saved(self, shape: StepShape) -> tuple[int, int, int]:
        """Elements of the saved activations and the workspace, and the own decompressor slot's
        bytes (:func:`step_memory`)."""
        raise NotImplementedError


class T1StepModel(StrategyStepModel):
    """Seal et al.'s TP (:class:`jphantom.nn.tensor.T1Linear`)."""

    def label(self, shape):
        return "tensor (T1)"

    def flops(self, shape):
        n, L, B, m = shape.width, shape.depth, shape.batch, shape.block
        inner = L - 1  # layers whose input gradient is computed (all but the first; module doc)
        forward = 2 * B * n * m * L
        backward = 2 * B * n * m * (L + inner)
        return {"forward": forward, "backward": backward, "total": forward + backward,
                "by_op": {"weight": forward + backward}, "gemms": 3 * L - 1,
                "decompressor_gemms": 0}

    def parameter_elements(self, shape):
        n, L, m = shape.width, shape.depth, shape.block
        return L * (m * n + m)

    def saved(self, shape):
        return shape.depth * shape.batch * shape.width, 0, 0


class PhantomStepModel(StrategyStepModel):
    """Phantom parallelism (:mod:`jphantom.nn.phantom.ops`), fused or unfused."""

    def check(self, shape):
        strategies.check_ghost_width(shape.strategy, shape.ghost_width)
        check_int("ghost_width", shape.ghost_width, 1, "it is k, the ghost neurons per rank")
        with warnings.catch_warnings():  # Eq. 8's bound: legal, only warned about
            warnings.simplefilter("ignore", JPhantomWarning)
            phantom.PhantomConfig(shape.width, shape.ghost_width, shape.num_shards, shape.depth)

    def label(self, shape):
        return "phantom (fused)" if shape.fused else "phantom (unfused)"

    def flops(self, shape):
        n, L, p, B, m = shape.width, shape.depth, shape.num_shards, shape.batch, shape.block
        inner = L - 1  # layers whose input gradient is computed (all but the first; module doc)
        k = shape.ghost_width
        local = 2 * B * m * m * (L + L + inner)  # forward, dL (Eq. 19), dy through L (Eq. 17)
        compressor = 2 * B * k * m * (L + L + inner)  # ghosts (Eq. 11), dC (Eq. 20), dy through C
        if shape.fused:
            slots = p  # one GEMM over all p slots, the own one masked
            decompressor = 3 * 2 * B * slots * k * m * L  # Eq. 11, messages (Eq. 17), dD (Eq. 21)
            corner = 2 * B * k * (p * k) * L  # Gamma^T G block of the fused outer product, unused
            forward = L * (2 * B * m * k + 2 * B * m * m + 2 * B * p * k * m)
            gemms = 3 * L + 2 * L + 2 * inner
            decompressor_gemms = 0
        else:
            decompressor = 3 * 2 * B * (p - 1) * k * m * L
            corner = 0
            forward = L * (2 * B * m * k + 2 * B * m * m + 2 * B * (p - 1) * k * m)
            decompressor_gemms = 3 * (p - 1) * L
            gemms = L * (2 + (p - 1)) + L * (2 * (p - 1) + 2) + 2 * inner
        total = local + compressor + decompressor + corner
        by_op = {"local": local, "compressor": compressor, "decompressor": decompressor}
        if shape.fused:
            by_op["fused_corner"] = corner
        return {"forward": forward, "backward": total - forward, "total": total, "by_op": by_op,
                "gemms": gemms, "decompressor_gemms": decompressor_gemms}

    def parameter_elements(self, shape):
        m, k, p = shape.block, shape.ghost_width, shape.num_shards
        return shape.depth * (m * m + k * m + p * m * k + m)

    def saved(self, shape):
        L, p, B, m, k = shape.depth, shape.num_shards, shape.batch, shape.block, shape.ghost_width
        if shape.fused:
            return L * B * (m + p * k), L * m * p * k, shape.dtype_bytes * L * m * k
        return (L - 1) * B * m + L * p * B * k, 0, shape.dtype_bytes * L * m * k


T1 = T1StepModel()
"""``tensor-t1``'s step model."""
PHANTOM = PhantomStepModel()
"""``phantom``'s and ``phantom-unfused``'s step model."""


def step_flops(shape: StepShape) -> dict:
    """Exact GEMM FLOPs per rank of one step (module docstring), 2 FLOPs per multiply-add.

    Returns ``forward``, ``backward``, ``total``, ``by_op`` (FLOPs of each family of products),
    ``gemms`` (matrix products per step: the ``dot`` ops of the compiled step) and
    ``decompressor_gemms`` (phantom unfused: the 3 (p-1) L small ones; else 0). Element-wise work
    (bias, ReLU, loss, optimizer update) is not counted.
    """
    return shape.model.flops(shape)


def step_collectives(shape: StepShape) -> list[dict]:
    """Exact collective inventory per rank of one step, ``[{"kind", "count", "bytes"}]`` merged per
    kind (``hlo.summarize``'s form, what ``CommModel.step_time_us`` takes); bytes are per-device
    result bytes. The strategy lists its own collectives
    (:func:`jphantom.costs.inventory.collective_inventory` on a ``model=p`` mesh), plus
    (``loss_allreduce``) the scalar all-reduce of the loss. A one-rank mesh has none (XLA removes
    collectives over a single device)."""
    if shape.num_shards == 1:
        return []
    from jphantom.costs.inventory import collective_inventory
    from jphantom.runtime.mesh import MeshConfig
    from jphantom.models.ffn import FFNConfig

    # float32 here only names the model; the inventory is in elements, bytes use shape.dtype.
    model = FFNConfig(width=shape.width, depth=shape.depth, ghost_width=shape.ghost_width)
    inventory = collective_inventory(
        model, shape.strategy_name, MeshConfig.of({"model": shape.num_shards}), shape.batch)
    buffers = {kind: list(sizes) for kind, sizes in inventory.items()}
    if shape.loss_allreduce:
        buffers.setdefault("all-reduce", []).append(1)
    return [{"kind": kind, "count": len(sizes), "bytes": shape.dtype_bytes * sum(sizes)}
            for kind, sizes in buffers.items() if sizes]


def parameter_elements(shape: StepShape) -> int:
    """Elements of the parameter arrays one rank stores (biases included; phantom's own D slot too)."""
    return shape.model.parameter_elements(shape)


def step_memory(shape: StepShape) -> dict:
    """Bytes per rank (module docstring): ``parameters``, ``gradients``, ``optimizer_state``,
    ``batch`` (exact array sizes), ``activations`` and ``workspace`` (modelled rule), ``total``
    (modelled peak), and ``own_decompressor_slot`` (phantom: the part of ``parameters`` that is the
    unused D^(j,j) block)."""
    L, B, m = shape.depth, shape.batch, shape.block
    size = shape.dtype_bytes
    params = size * parameter_elements(shape)
    hidden_and_loss = L * B * m  # L-1 ReLU pre-activations + the MSE residual
    saved, workspace, own_slot = shape.model.saved(shape)
    memory = {
        "parameters": params,
        "gradients": params,
        "optimizer_state": shape.optimizer_states * params,
        "batch": size * 2 * B * m,
        "activations": size * (saved + hidden_and_loss),
        "workspace": size * workspace,
    }
    memory["total"] = sum(memory.values())
    memory["own_decompressor_slot"] = own_slot
    return memory


EXACT_MEMORY = ("parameters", "gradients", "optimizer_state", "batch", "own_decompressor_slot")


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """The model of one step per rank. ``flops``, ``collectives``, ``collective_bytes`` and the
    memory entries in ``EXACT_MEMORY`` are exact formulas; ``seconds``, the other memory entries and
    ``fits_in_memory`` are modelled (``as_dict`` files them under "exact" and "modelled")."""

    shape: StepShape
    device: DeviceSpec
    comm_model_name: str
    gemm_overhead_s: float
    flops: dict
    collectives: list
    memory: dict
    seconds: dict

    @property
    def collective_bytes(self) -> int:
        return sum(row["bytes"] for row in self.collectives)

    @property
    def total_seconds(self) -> float:
        return self.seconds["total"]

    @property
    def fits_in_memory(self) -> bool:
        return self.memory["total"] <= self.device.memory_bytes

    def as_dict(self) -> dict:
        return {
            "config": dataclasses.asdict(self.shape) | {"label": self.shape.label},
            "exact": {
                "flops": self.flops,
                "collectives": self.collectives,
                "collective_bytes": self.collective_bytes,
                "memory_bytes": {key: self.memory[key] for key in EXACT_MEMORY},
            },
            "modelled": {
                "memory_bytes": {key: value for key, value in self.memory.items()
                                 if key not in EXACT_MEMORY},
                "fits_in_memory": self.fits_in_memory,
                "memory_fraction": self.memory["total"] / self.device.memory_bytes,
                "seconds": self.seconds,
            },
            "assumptions": {
                "device": self.device.as_dict(),
                "comm_model": self.comm_model_name,
                "gemm_overhead_s": self.gemm_overhead_s,
                "overlap": "none: total = compute + comm + overhead",
            },
        }


def estimate_step(shape: StepShape, *, device: DeviceSpec = MI250X_GCD,
                  comm_model: CommModel = FRONTIER, gemm_overhead_s: float = 0.0) -> StepEstimate:
    """FLOPs, collectives, memory and modelled seconds of one step per rank (module docstring).

    ``gemm_overhead_s`` is charged once per small decompressor GEMM of phantom with ``fused=False``
    (3 (p-1) L per step); it is ignored for the fused layout and for TP.
    """
    if not isinstance(shape, StepShape):
        raise ConfigError(f"shape={shape!r} must be a StepShape")
    if not isinstance(device, DeviceSpec):
        raise ConfigError(f"device={device!r} must be a DeviceSpec, e.g. step_model.MI250X_GCD")
    if not isinstance(comm_model, CommModel):
        raise ConfigError(f"comm_model={comm_model!r} must be a CommModel, e.g. comm_model.FRONTIER")
    overhead = check_real("gemm_overhead_s", gemm_overhead_s, low=0.0, low_inclusive=True,
                           fix="give seconds per small GEMM, e.g. 10e-6 for a GPU kernel launch")
    flops = step_flops(shape)
    collectives = step_collectives(shape)
    compute = flops["total"] / device.flops_per_second
    comm = comm_model.step_time_us(collectives, shape.num_shards) * 1e-6 if collectives else 0.0
    extra = flops["decompressor_gemms"] * overhead
    seconds = {"compute": compute, "comm": comm, "gemm_overhead": extra,
               "total": compute + comm + extra}
    return StepEstimate(shape, device, comm_model.name, overhead, flops, collectives,
                        step_memory(shape), seconds)


def break_even_gemm_overhead(tensor_step: StepEstimate, unfused_step: StepEstimate) -> float:
    """Seconds per small decompressor GEMM at which unfused phantom's modelled step equals TP's:
    (t_TP - t_phantom without overhead) / (3 (p-1) L). Negative: phantom is slower even with no
    overhead; ``math.inf`` if the phantom step has no small GEMMs (p = 1)."""
    if tensor_step.shape.model is not T1 or unfused_step.shape.model is not PHANTOM \
            or unfused_step.shape.fused:
        raise ConfigError("break_even_gemm_overhead needs a 'tensor-t1' estimate and an unfused "
                          "'phantom' estimate (StepShape(..., fused=False))")
    gemms = unfused_step.flops["decompressor_gemms"]
    slack = tensor_step.total_seconds - (unfused_step.seconds["compute"] + unfused_step.seconds["comm"])
    return slack / gemms if gemms else math.inf
