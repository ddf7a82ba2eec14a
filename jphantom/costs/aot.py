"""Ahead-of-time compilation for accelerators this machine does not have: H100/A100 nodes, TPU slices.

XLA compiles for a device it cannot reach. ``jax.experimental.topologies.get_topology_desc`` gives
the devices of a target -- with the CUDA plugin (``jax-cuda12-plugin``, ``jax-cuda12-pjrt`` and
``nvidia-cuda-nvcc-cu12`` for ``ptxas``/``libdevice``, at the installed jax's version) and a
``stream_executor.GpuTargetConfigProto`` describing the GPU, ``nodes x gpus_per_node`` GPUs; with
``libtpu``, a TPU slice -- and ``jax.jit(step).lower(...).compile()`` over a mesh of them yields the
target's optimised HLO (asynchronous ``*-start``/``*-done`` collectives, fusions, the GPU's
collective scheduling) and ``memory_analysis()`` per device, on a CPU-only machine (MaxText's
``train_compile.py`` does this for TPUs). Nothing runs; nothing is allocated.

:class:`Target` names the hardware (``gpu:h100``, ``gpu:a100``, ``tpu:v5p:2x2x2``...), and
:func:`compile_report` builds the training step exactly as ``train`` would (the same
:class:`jphantom.config.RunConfig`, the one ``shard_map``), on the target's devices placed by node
(:func:`jphantom.runtime.mesh.node_split`: the innermost axes inside a node's NVLink domain), compiles it
and reports per device:

- memory from XLA (arguments, outputs, temporaries, and the peak they imply) against the device's
  memory. XLA's GPU compile does not fail when a program needs more than the device has (a 93 GB
  peak compiles for an 80 GB H100), so ``fits`` is this comparison, not the compiler's verdict;
- every collective: kind, mesh axes, bytes and executions per step, whether XLA issued it
  asynchronously and how many compute ops it scheduled under it, and whether its groups cross nodes;
- model FLOPs per device (the optimised HLO's GEMMs, :func:`jphantom.analysis.hlo.dot_flops`,
  XLA:GPU's cuBLAS calls included: equal to the CPU compile's) and XLA's ``cost_analysis()``
  where the backend gives one (the GPU path returns ``None``: reported as unavailable);
- the kernels that decide its speed (:func:`jphantom.analysis.hlo.kernels`): cuDNN's fused
  attention calls, the GEMMs by emitter and how many read FP8, and how many asynchronous
  collectives have GEMMs scheduled under them (the overlap a collective matmul is after);
- compile seconds, the XLA flags it was compiled with (on GPUs :mod:`jphantom.runtime.gpu_defaults`' where
  ``XLA_FLAGS`` does not set them), jax/jaxlib/plugin versions.

Modelled, not measured: nothing here has a time. GEMM autotuning does not run without a GPU, so the
kernels a real GPU picks may differ (the collectives and buffers do not depend on them).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.resources
import math
import re
from pathlib import Path

from jphantom.costs.budget import SLOP_FLAG, GpuMemory, compiled_io_bytes
from jphantom.costs.metrics import peak_of_kind
from jphantom.errors import ConfigError

GPU_TARGETS = {
    # chip: (description file, HBM bytes as the description gives them, GPUs per node,
    #        dense bf16 TFLOP/s: jphantom.costs.metrics.peak_of_kind, the device descriptions')
    "h100": ("h100_sxm.txtpb", 84942979072, 8, peak_of_kind("h100 sxm")),
    "h200": ("h200_sxm.txtpb", 150754820096, 8, peak_of_kind("h200")),
    "a100": ("a100_sxm_80.txtpb", 85100068864, 8, peak_of_kind("a100")),
}
ROCM_TARGETS = {
    # chip: (description file, HBM bytes as the description gives them, devices per node, dense
    #        bf16 TFLOP/s). MI250X: one jax device is one GCD (half a package); Frontier's node
    #        has 4 MI250X = 8 GCDs. XLA's own descriptions (jphantom/targets/*.txtpb).
    "mi250x": ("mi250x_gcd.txtpb", 67628957696, 8, peak_of_kind("mi250x")),
    "mi300x": ("mi300x.txtpb", 206158430208, 8, peak_of_kind("mi300x")),
    "mi350x": ("mi350x.txtpb", 270566162432, 8, peak_of_kind("mi350x")),
}
TPU_TARGETS = {
    # chip: (HBM bytes per chip, chips per host, dense bf16 TFLOP/s per chip; Google Cloud's docs)
    "v4": (32 * 2**30, 4, peak_of_kind("tpu v4")),
    "v5e": (16 * 2**30, 4, peak_of_kind("tpu v5e")),
    "v5p": (95 * 2**30, 4, peak_of_kind("tpu v5p")),
    "v6e": (32 * 2**30, 4, peak_of_kind("tpu v6e")),
}
GPU_INSTALL = "pip install 'jphantom[aot]'"
ROCM_INSTALL = "pip install 'jphantom[rocm]'"
_DESCRIBED = {"gpu": GPU_TARGETS, "rocm": ROCM_TARGETS}
TPU_INSTALL = "pip install 'jphantom[tpu]'"


@dataclasses.dataclass(frozen=True)
class Target:
    """The hardware a step is compiled for. ``platform`` ``gpu`` (NVIDIA), ``rocm`` (AMD) or
    ``tpu``; ``chip`` a key of :data:`GPU_TARGETS` / :data:`ROCM_TARGETS` / :data:`TPU_TARGETS`;
    GPUs: ``nodes`` x ``devices_per_node`` (an MI250X's device is one GCD), optionally
    ``target_config`` (a path to a user's ``GpuTargetConfigProto`` text, instead of the shipped
    one); TPUs: ``topology`` (``4x4x4``: chips along each torus axis). Validated on construction.
    ``Target.parse("gpu:h100", nodes=4)``, ``Target.parse("rocm:mi250x", nodes=2)``,
    ``Target.parse("tpu:v5p:2x2x2")``."""

    platform: str
    chip: str
    nodes: int = 1
    devices_per_node: int = 8
    topology: str = ""
    target_config: str | None = None

    def __post_init__(self):
        if self.platform not in ("gpu", "rocm", "tpu"):
            raise ConfigError(f"target platform {self.platform!r}: use gpu:CHIP, rocm:CHIP or "
                              "tpu:CHIP:TOPOLOGY, e.g. gpu:h100, rocm:mi250x or tpu:v5p:2x2x2")
        known = _DESCRIBED.get(self.platform, TPU_TARGETS)
        if self.chip not in known and not (self.is_gpu and self.target_config):
            raise ConfigError(f"target {self.platform}:{self.chip}: known chips are "
                              f"{', '.join(f'{self.platform}:{c}' for c in known)}"
                              + (" (or give --target-config FILE for another GPU)"
                                 if self.is_gpu else ""))
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a whole number >= 1")
        if self.platform == "tpu":
            if not re.fullmatch(r"\d+(x\d+){1,2}", self.topology):
                raise ConfigError(f"TPU topology {self.topology!r}: give chips per torus axis, "
                                  "e.g. tpu:v5p:2x2x2 or tpu:v5e:4x4")
        if self.target_config is not None and not Path(self.target_config).is_file():
            raise ConfigError(f"--target-config {self.target_config}: no such file (give a "
                              "stream_executor.GpuTargetConfigProto in text form)")

    @classmethod
    def parse(cls, text: str, *, nodes: int = 1, gpus_per_node: int | None = None,
              target_config: str | None = None) -> Target:
        parts = str(text).split(":")
        if parts[0] in _DESCRIBED and len(parts) == 2:
            chip = parts[1]
            per_node = gpus_per_node or _DESCRIBED[parts[0]].get(chip, (None, None, 8))[2]
            return cls(parts[0], chip, nodes, per_node, target_config=target_config)
        if parts[0] == "tpu" and len(parts) == 3:
            if gpus_per_node is not None or nodes != 1:
                raise ConfigError("a TPU target's size is its topology (tpu:v5p:4x4x4): leave "
                                  "--nodes and --gpus-per-node out")
            return cls("tpu", parts[1], topology=parts[2])
        raise ConfigError(f"--target {text!r}: write gpu:CHIP (gpu:h100, gpu:h200, gpu:a100), "
                          "rocm:CHIP (rocm:mi250x, rocm:mi300x, rocm:mi350x) or "
                          "tpu:CHIP:TOPOLOGY (tpu:v5p:2x2x2)")

    @property
    def is_gpu(self) -> bool:
        """NVIDIA or AMD: nodes of GPUs described by a ``GpuTargetConfigProto``."""
        return self.platform in _DESCRIBED

    @property
    def device_count(self) -> int:
        if self.platform == "tpu":
            return math.prod(int(n) for n in self.topology.split("x"))
        return self.nodes * self.devices_per_node

    @property
    def name(self) -> str:
        if self.platform == "tpu":
            return f"tpu:{self.chip}:{self.topology}"
        return f"{self.platform}:{self.chip} x {self.nodes} node(s) x {self.devices_per_node}"

    @property
    def memory_bytes(self) -> int:
        """One device's memory (HBM), as the target description gives it."""
        if self.platform == "tpu":
            return TPU_TARGETS[self.chip][0]
        if self.target_config is not None:
            found = re.search(r"device_memory_size:\s*(\d+)", self.config_text())
            if not found:
                raise ConfigError(f"--target-config {self.target_config} has no "
                                  "device_memory_size: add it (bytes of one GPU's memory)")
            return int(found[1])
        return _DESCRIBED[self.platform][self.chip][1]

    @property
    def peak_tflops(self) -> float | None:
        """Dense bf16 TFLOP/s of one device from its datasheet (None for a user's GPU)."""
        if self.platform == "tpu":
            return TPU_TARGETS[self.chip][2]
        table = _DESCRIBED[self.platform]
        return table[self.chip][3] if self.chip in table else None

    def config_text(self) -> str:
        """The GPU's ``GpuTargetConfigProto`` text: the user's file, else the shipped one."""
        if self.target_config is not None:
            return Path(self.target_config).read_text()
        file = _DESCRIBED[self.platform][self.chip][0]
        return importlib.resources.files("jphantom.targets").joinpath(file).read_text()

    def devices(self) -> list:
        """The target's devices (``jax.experimental.topologies``): compile for them, never run."""
        require_plugin(self.platform)
        if self.platform == "rocm":
            from jphantom import rocm

            rocm.prepare()  # before jax's backends start: stand-ins, the GPU-count shim
        import jax
        from jax.experimental import topologies

        if not jax.config.jax_platforms:
            # Without a GPU the CUDA plugin registers (and offers its topology API) only when the
            # platforms jax starts are named and exclude it; this takes effect if jax's backends
            # have not started yet (else set JAX_PLATFORMS=cpu before starting Python).
            jax.config.update("jax_platforms", "cpu")

        if self.is_gpu:
            describe = functools.partial(
                topologies.get_topology_desc, platform="cuda" if self.platform == "gpu" else
                "rocm", topology_name="", target_config=self.config_text(),
                topology=f"1x{self.nodes}x{self.devices_per_node}")
            try:
                topology = describe()
            except NotImplementedError:
                if self.platform != "rocm":
                    raise
                from jphantom import rocm  # jax discovered its plugins before the shim

                rocm.register_plugin()
                topology = describe()
        else:
            topology = topologies.get_topology_desc(platform="tpu",
                                                    topology_name=f"{self.chip}:{self.topology}")
        return list(topology.devices)

    def as_dict(self) -> dict:
        out = {"name": self.name, "platform": self.platform, "chip": self.chip,
               "devices": self.device_count, "memory_bytes": self.memory_bytes,
               "peak_bf16_tflops": self.peak_tflops}
        if self.is_gpu:
            shipped = f"jphantom/targets/{_DESCRIBED[self.platform].get(self.chip, ('',))[0]}"
            out |= {"nodes": self.nodes, "devices_per_node": self.devices_per_node,
                    "target_config": self.target_config or shipped}
        if self.platform == "rocm":
            from jphantom import rocm

            out["runtime_stand_ins"] = rocm.stand_ins()
        else:
            out["topology"] = self.topology
        return out


def versions() -> dict[str, str | None]:
    """jax's and the compiler plugins' versions (recorded with every compiled number)."""
    out = {}
    for package in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                    "nvidia-cuda-nvcc-cu12", "nvidia-cudnn-cu12", "jax-rocm7-pjrt",
                    "jax-rocm7-plugin", "libtpu"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def plugin_problem(platform: str) -> str | None:
    """Why this environment cannot compile for ``platform`` (``gpu``/``rocm``/``tpu``), or None."""
    if platform == "rocm":
        from jphantom import rocm

        return rocm.problem()
    have = versions()
    if platform == "gpu":
        missing = [p for p in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12")
                   if have[p] is None]
        if missing:
            return (f"compiling for a GPU needs {', '.join(missing)} (at jax's version "
                    f"{have['jax']}): {GPU_INSTALL}")
        wrong = [p for p in ("jax-cuda12-plugin", "jax-cuda12-pjrt") if have[p] != have["jaxlib"]]
        if wrong:
            return (f"{wrong[0]} {have[wrong[0]]} differs from jaxlib {have['jaxlib']}: the plugin "
                    f"must match it: pip install '{wrong[0]}=={have['jaxlib']}'")
        return None
    if have["libtpu"] is None:
        return f"compiling for a TPU needs libtpu: {TPU_INSTALL}"
    return None


def require_plugin(platform: str) -> None:
    problem = plugin_problem(platform)
    if problem:
        raise ConfigError(problem)


def deviceless_node(name: str = "gpu:h100", nodes: int = 1) -> tuple["Target", list]:
    """``name``'s target of ``nodes`` nodes and its devices, for a script that compiles several
    runs for it (:func:`compile_report`'s ``devices``); :class:`ConfigError` when this
    environment has no compiler for it (:func:`plugin_problem`)."""
    target = Target.parse(name, nodes=nodes)
    require_plugin(target.platform)
    return target, target.devices()


# -------------------------------------------------------------------------------------------------
# Compile a run for a target and report it
# -------------------------------------------------------------------------------------------------


def compile_report(flags: dict, target: Target, *, devices: list | None = None,
                   gpu_defaults: bool = True, hlo_out: str | Path | None = None,
                   predict_on=None, top: int = 10) -> dict:
    """Build the run of ``flags`` (:meth:`jphantom.config.RunConfig.from_flags` names) on
    ``target``'s devices (``devices``: already fetched ones, to share them between runs), compile
    its training step and report it (module docstring). For a GPU target the compile gets
    :mod:`jphantom.runtime.gpu_defaults`' XLA flags where ``XLA_FLAGS`` does not name them
    (``gpu_defaults=False``: only ``XLA_FLAGS``; an FP8 run on NVIDIA GPUs also gets
    ``FP8_XLA_FLAGS``), passed to this compilation so that they hold even if jax started before
    they were set; the report's ``xla_flags`` lists the flags it ran
    with. ``hlo_out``: also write the optimised HLO text there. ``predict_on``: a
    :class:`jphantom.predict.DeviceModel` to play the compiled program on
    (:func:`jphantom.predict.predict`; the report's ``prediction``: step seconds, MFU, tokens/s
    per GPU, joules, all modelled; its ``top_ops`` the ``top`` longest). Raises :class:`ConfigError` for a run that cannot be built
    (before compiling) or a mesh whose size is not the target's."""
    from jphantom.analysis.hlo import collectives, kernels
    from jphantom.analysis.compiled import (compile_built, compiled_memory, gemm_flops,
                                           normalise_collectives, state_bytes)
    from jphantom.config import RunConfig, pipeline_summary
    from jphantom.runtime.mesh import axes_across_nodes, device_pool, node_split

    mesh_text = _mesh_of(flags, target)
    use_defaults = gpu_defaults and target.is_gpu
    xla_flags, options = _compile_flags(flags, target, use_defaults)
    budget, options_for, passed = _run_budget(target, use_defaults, xla_flags)
    devices = target.devices() if devices is None else devices
    with device_pool(devices):
        config = RunConfig.from_flags(**{**flags, "mesh": mesh_text})
        built = config.build()
        program, mesh, step = built.program, built.mesh, built.step
        compiled, compile_seconds = compile_built(config, program, step, options,
                                                  options_for=options_for)
    text = compiled.as_text()
    if hlo_out is not None:
        Path(hlo_out).parent.mkdir(parents=True, exist_ok=True)
        Path(hlo_out).write_text(text)
    found = normalise_collectives(collectives(text))
    axes = dict(mesh.shape)
    node_of = [d.process_index for d in mesh.devices.flat]
    ops = [_collective_row(c, axes, node_of) for c in found]
    memory = compiled_memory(compiled) | state_bytes(step)
    peak = memory_peak(memory)
    split = node_split(program.mesh, devices[:mesh.size])
    cost = _cost_analysis(compiled)
    report = {
        "strategy": config.parallel.strategy,
        "mesh": str(program.mesh),
        "config": config.flat(),
        "target": target.as_dict(),
        "placement": {"inside_node": split[0], "across_nodes": split[1]} if split else
                     {"inside_node": dict(axes), "across_nodes": {}},
        "axes_across_nodes": list(axes_across_nodes(mesh)),
        "memory": memory | _fit(peak, memory, target, budget),
        "collectives": _summary(found, axes, node_of),
        "collective_ops": ops,
        "collective_bytes": sum(r["bytes"] * r["count"] for r in ops if not r["trivial"]),
        "model_flops": gemm_flops(compiled) or None,
        "xla_cost_analysis": cost,
        "kernels": kernels(text),
        "rematerialised": rematerialised(text),
        "params": program.param_count,
        "compile_seconds": compile_seconds,
        "xla_flags": [w for w in xla_flags.split() if not (passed and w.startswith(SLOP_FLAG))]
        + [f"--{name}={value}" for name, value in passed.items()],
        "gpu_defaults": use_defaults,
        "versions": versions(),
    }
    if hlo_out is not None:
        report["hlo_file"] = str(hlo_out)
    if step.pipeline is not None:
        report["pipeline"] = pipeline_summary(step.pipeline, program.mesh)
    if predict_on is not None:
        report["prediction"] = _prediction(text, predict_on, config, program, node_of,
                                           target, peak, report["memory"]["limit_bytes"],
                                           top).as_dict()
    report["notes"] = _notes(report, target)
    return report


def _run_budget(target: Target, use_defaults: bool, xla_flags: str):
    """A GPU target's run memory (:class:`GpuMemory`; None elsewhere), the ``options_for`` hook
    of :func:`jphantom.analysis.compiled.compile_built` that gives XLA the run's budget, and the
    dict in which the hook records the options it passed."""
    if not target.is_gpu:
        return None, None, {}
    budget, passed = GpuMemory.of(target.memory_bytes, use_defaults, xla_flags), {}

    def options_for(lowered, arguments) -> dict:
        passed.update(budget.compiler_options(lowered, arguments))
        return passed

    return budget, options_for, passed


def _fit(peak: int, memory: dict, target: Target, budget: GpuMemory | None) -> dict:
    """The peak against the run's memory: the allocator's limit on a GPU (:meth:`GpuMemory.
    report`), the device's memory on a TPU."""
    device = {"peak_bytes": peak, "device_bytes": target.memory_bytes,
              "limit_bytes": target.memory_bytes, "fits": peak <= target.memory_bytes}
    return device | (budget.report(peak, memory) if budget is not None else {})


def _compile_flags(flags: dict, target: Target, use_defaults: bool) -> tuple[str, dict | None]:
    """``XLA_FLAGS`` with :mod:`jphantom.runtime.gpu_defaults`' flags where it does not name them
    (``use_defaults``; on NVIDIA an FP8 run's GEMMs also to cuBLAS-LT's FP8 calls,
    ``gpu_defaults.FP8_XLA_FLAGS``; a pipelined run's ``PIPELINE_XLA_FLAGS``), and the compile
    options that carry them (None without)."""
    import os

    from jphantom.runtime import gpu_defaults as defaults

    xla_flags = os.environ.get("XLA_FLAGS", "")
    if not use_defaults:
        return xla_flags, None
    wanted = defaults.current(precision=flags.get("precision") if target.platform == "gpu"
                              else None, pipelined=defaults.is_pipelined(flags.get("mesh")))
    xla_flags, _ = defaults.merge_flags(xla_flags, wanted)
    return xla_flags, defaults.compiler_options(xla_flags, wanted)


def _mesh_of(flags: dict, target: Target) -> str:
    """The run's mesh text (default: :func:`default_mesh`), checked against the target's size."""
    from jphantom.runtime.mesh import MeshConfig

    mesh_text = flags.get("mesh") or default_mesh(target)
    if MeshConfig.parse(mesh_text).device_count != target.device_count:
        raise ConfigError(f"mesh {mesh_text} has {MeshConfig.parse(mesh_text).device_count} "
                          f"devices; the target {target.name} has {target.device_count}: give a "
                          "mesh whose sizes multiply to it")
    return mesh_text


_REMATERIALISED = re.compile(r"^\s*(?:ROOT\s+)?%[^\s=]*\.remat\d*(?:\.[^\s=]*)?\s+=", re.M)


def rematerialised(hlo_text: str) -> int:
    """How many instructions of an optimised HLO module are XLA's rematerialisation clones (the
    ``.remat`` names its ``HloRematerialization`` pass gives the copies it runs again)."""
    return len(_REMATERIALISED.findall(hlo_text))


def _notes(report: dict, target: Target) -> list[str]:
    """What a compile report's figures leave out, said in its notes."""
    notes = []
    if report["model_flops"] is None:
        notes.append("no dot or cuBLAS call in the optimised HLO (XLA:TPU writes its matmuls as "
                     "convolutions): model FLOPs not counted; see XLA's cost analysis")
    if report["xla_cost_analysis"] is None:
        notes.append("XLA's cost_analysis() is unavailable for this target on this path (None)")
    if report["kernels"]["attention"]["forward"]:
        notes.append("model FLOPs count the GEMMs XLA compiled; the attention inside cuDNN's "
                     "fused attention calls (custom calls, not dots) is not in them")
    if target.is_gpu:
        notes.append("compiled without a GPU: GEMM autotuning did not run, so a real GPU may "
                     "pick other kernels (collectives and buffers are the compiler's)")
    if report["target"].get("runtime_stand_ins"):
        notes.append(f"compiled against {len(report['target']['runtime_stand_ins'])} stand-ins "
                     "for ROCm's runtime libraries (jphantom.rocm.stubs): nothing can run in "
                     "this process")
    memory = report["memory"]
    if target.is_gpu:
        fraction = memory["allocator_fraction"]
        allocator = ("the platform allocator (no limit)" if fraction is None else
                     f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction:g}")
        notes.append(f"compiled to the run's memory: {allocator} gives jax's allocator "
                     f"{memory['limit_bytes'] / 2**30:.1f} of the device's "
                     f"{memory['device_bytes'] / 2**30:.1f} GiB, and jax passes that limit to "
                     "XLA, whose scheduler and rematerialisation aim at it less the inputs and "
                     "outputs, times --xla_gpu_memory_limit_slop_factor percent (jphantom.costs."
                     "budget; the compile here sets the slop factor that gives XLA that budget)")
    if report["rematerialised"] and target.is_gpu:
        notes.append(f"XLA rematerialised {report['rematerialised']} instructions (run again in "
                     "the step) to fit that budget: a larger XLA_PYTHON_CLIENT_MEM_FRACTION or "
                     "slop factor gives it more room (docs/predict.md)")
    if not memory["fits"]:
        limit = memory["limit_bytes"]
        where = (f"the {limit / 2**30:.1f} GiB jax's allocator takes" if limit < memory[
            "device_bytes"] else f"the device's {limit / 2**30:.1f} GiB")
        needed = memory.get("fraction_needed")
        advice = ("; XLA_PYTHON_CLIENT_MEM_FRACTION at least "
                  f"{math.ceil(needed * 100) / 100:g} would hold it (compile again with it set: "
                  "XLA's budget grows with it)" if needed is not None and needed <= 1 else
                  "; it would fail to allocate")
        notes.append(f"peak {memory['peak_bytes'] / 2**30:.1f} GiB exceeds {where}: XLA "
                     f"compiled it anyway{advice}")
    return notes


def _prediction(text: str, device, config, program, node_of: list[int], target: Target,
                peak: int, limit: int, top: int = 10):
    """The compiled program played on ``device`` (:func:`jphantom.predict.predict`), with the
    run's tokens per step and the model's FLOPs per device for MFU, its ``peak`` against the
    run's memory ``limit``."""
    from jphantom.costs.metrics import flops_per_token
    from jphantom.predict import predict

    seq_len = config.model.seq_len if config.model.family.is_language_model else 1
    tokens = config.train.batch * seq_len
    per_token = flops_per_token(program.config, config.parallel.strategy, seq_len)
    flops = None if per_token is None else per_token * tokens / len(node_of)
    return predict(text, device, devices=len(node_of), gpus_per_node=target.devices_per_node,
                   node_of=lambda i: node_of[i] if i < len(node_of) else 0,
                   tokens_per_step=tokens, model_flops_per_step=flops, peak_memory_bytes=peak,
                   memory_limit_bytes=limit, top=top)


def default_mesh(target: Target) -> str:
    """Tensor parallelism inside a node, data parallelism across nodes (GPUs); ``data=N`` on a TPU
    slice."""
    if target.platform == "tpu":
        return f"data={target.device_count}"
    return ",".join(f"{name}={size}" for name, size in
                    (("data", target.nodes), ("model", target.devices_per_node)) if size > 1) \
        or "model=1"


def memory_peak(memory: dict) -> int:
    """Bytes a device holds at the step's peak from ``memory_analysis()``: arguments + outputs -
    aliased (outputs donated into arguments' buffers) + temporaries (MaxText's
    ``train_compile.py`` sums them the same way)."""
    return compiled_io_bytes(memory) + memory.get("temp_bytes", 0)


def _cost_analysis(compiled) -> dict | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 -- a backend without one raises instead of returning None
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost:
        return None
    return {key: float(value) for key, value in cost.items()
            if key in ("flops", "transcendentals", "bytes accessed")}


def _crosses_nodes(c, node_of: list[int]) -> bool:
    return any(len({node_of[m] for m in group if m < len(node_of)}) > 1
               for group in c.device_groups(len(node_of)))


def _collective_row(c, axes: dict, node_of: list[int]) -> dict:
    return {"kind": c.kind, "axes": list(c.mesh_axes(axes)),
            "shapes": [[d, list(s)] for d, s in c.shapes], "bytes": c.bytes, "count": c.count,
            "asynchronous": c.asynchronous, "overlapped_ops": c.overlapped,
            "overlapped_gemms": c.overlapped_gemms,
            "crosses_nodes": _crosses_nodes(c, node_of), "trivial": c.trivial}


def _summary(found, axes: dict, node_of: list[int]) -> list[dict]:
    """:func:`jphantom.analysis.hlo.summarize`'s rows per (kind, axes) of the collectives that
    move data, each with how many of its executions were asynchronous, overlapped with compute,
    and crossing nodes."""
    from jphantom.analysis.hlo import summarize

    moving = [c for c in found if not c.trivial]
    rows = summarize(moving, axes=axes)
    for row in rows:
        same = [c for c in moving if (c.kind, c.mesh_axes(axes)) == (row["kind"], row["axes"])]
        row.update(axes=list(row["axes"]),
                   asynchronous=sum(c.count for c in same if c.asynchronous),
                   overlapped=sum(c.count for c in same if c.overlapped),
                   crosses_nodes=sum(c.count for c in same if _crosses_nodes(c, node_of)))
    return rows


def format_compile_report(report: dict) -> str:
    """The human table: memory against the device, FLOPs, the kernels that matter
    (:func:`jphantom.analysis.hlo.format_kernels`) and the XLA flags, then one line per collective
    kind and axes."""
    from jphantom.analysis.hlo import format_kernels

    m, t = report["memory"], report["target"]
    gib = 2**30
    lines = [
        f"{report['strategy']} on {report['mesh']}, compiled for {t['name']} "
        f"({t['devices']} devices) in {report['compile_seconds']:.1f} s",
        f"placement: inside a node {_axes_text(report['placement']['inside_node'])}; across "
        f"nodes {_axes_text(report['placement']['across_nodes']) or '-'}",
        f"memory per device: arguments {m.get('argument_bytes', 0) / gib:.2f} GiB, outputs "
        f"{m.get('output_bytes', 0) / gib:.2f} GiB (aliased {m.get('alias_bytes', 0) / gib:.2f}), "
        f"temporaries {m.get('temp_bytes', 0) / gib:.2f} GiB -> peak {m['peak_bytes'] / gib:.2f} "
        f"GiB of {m['device_bytes'] / gib:.1f} GiB: {'fits' if m['fits'] else 'DOES NOT FIT'}",
        "model FLOPs per device " + (f"{report['model_flops'] / 1e9:.4g} GFLOP per step"
                                     if report["model_flops"] else "not counted") + "; XLA cost "
        f"analysis: {_cost_text(report['xla_cost_analysis'])}",
        f"kernels: {format_kernels(report['kernels'])}",
        "XLA flags: " + (" ".join(report["xla_flags"]) or "none")
        + (" (jphantom's GPU defaults where XLA_FLAGS did not set them)"
           if report["gpu_defaults"] else ""),
        "",
        f"{'collective':<20} {'axes':<16} {'count':>7} {'MB/device':>11} {'async':>7} "
        f"{'overlap':>8} {'x-node':>7}",
    ]
    for row in report["collectives"]:
        lines.append(f"{row['kind']:<20} {','.join(row['axes']) or '-':<16} {row['count']:>7} "
                     f"{row['bytes'] / 1e6:>11.2f} {row['asynchronous']:>7} "
                     f"{row['overlapped']:>8} {row['crosses_nodes']:>7}")
    lines.append(f"{'total':<20} {'':<16} {sum(r['count'] for r in report['collectives']):>7} "
                 f"{report['collective_bytes'] / 1e6:>11.2f}")
    return "\n".join(lines)


def write_reports(reports: list[dict], out: str | Path) -> None:
    """``out/compile.json`` (the reports) and ``out/compile.png``: per run, the peak memory per
    device split into XLA's arguments, outputs and temporaries against the device's memory, and
    the collective bytes per device per mesh axes, split into what crosses nodes and what stays
    inside one."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(reports, indent=2) + "\n")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.6 * len(reports)))
    labels = [f"{r['strategy']} {r['mesh']}" for r in reports]
    gib = 2**30
    bottom = [0.0] * len(reports)
    for field in ("argument_bytes", "output_bytes", "temp_bytes"):
        values = [r["memory"].get(field, 0) / gib
                  - (r["memory"].get("alias_bytes", 0) / gib if field == "output_bytes" else 0)
                  for r in reports]
        left.barh(labels, values, left=bottom, label=field.replace("_bytes", ""))
        bottom = [b + v for b, v in zip(bottom, values)]
    left.axvline(reports[0]["target"]["memory_bytes"] / gib, color="k", linestyle="--",
                 label="device memory")
    left.set_xlabel("GiB per device (XLA memory_analysis)")
    left.legend(fontsize=7)
    inside, across = [], []
    for r in reports:
        ops = [o for o in r["collective_ops"] if not o["trivial"]]
        across.append(sum(o["bytes"] * o["count"] for o in ops if o["crosses_nodes"]) / 1e6)
        inside.append(sum(o["bytes"] * o["count"] for o in ops if not o["crosses_nodes"]) / 1e6)
    right.barh(labels, inside, label="inside a node")
    right.barh(labels, across, left=inside, label="across nodes")
    right.set_xlabel("collective MB per device per step (compiled HLO)")
    right.legend(fontsize=7)
    right.set_yticks([])
    fig.suptitle(f"compiled for {reports[0]['target']['name']} (no time measured)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "compile.png", dpi=120)
    plt.close(fig)


def _axes_text(axes: dict) -> str:
    return ",".join(f"{name}={size}" for name, size in axes.items() if size > 1)


def _cost_text(cost: dict | None) -> str:
    if cost is None:
        return "unavailable (None on this path)"
    return ", ".join(f"{key} {value:.3g}" for key, value in cost.items())


__all__ = ["GPU_TARGETS", "TPU_TARGETS", "Target", "compile_report",
           "default_mesh",
           "format_compile_report", "memory_peak", "plugin_problem", "versions", "write_reports"]
