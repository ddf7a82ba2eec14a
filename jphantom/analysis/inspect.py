"""Compile one training step (forward + backward + optimizer update, SGD by default) and report
what it does.

The step is :func:`jphantom.step.make_train_step`'s (one ``jax.jit`` of one ``shard_map`` over the
mesh, e.g. ``data=2,model=4``). From the compiled executable: every collective (kind, shape, dtype,
bytes, replica groups, the mesh axes it spans, and how many times it runs per step: layers under
``lax.scan`` run inside an HLO loop, whose trip count multiplies) parsed from the optimized HLO,
GEMM FLOPs from the HLO's ``dot`` ops (trip counts applied; ``cost_analysis()`` counts a loop body
once and is reported next to them), memory from ``memory_analysis()``; plus the model's parameter
count, and the per-device bytes of the parameters, gradients and optimizer state from their
shardings (what ZeRO shards over ``data``). Nothing is executed, and parameters are abstract, so
large widths inspect without allocating them.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np
import optax

from jphantom import strategies
from jphantom.analysis.hlo import collectives, dot_flops, normalise_replica_groups, summarize
from jphantom.errors import ConfigError, check_int
from jphantom.mesh import MeshConfig, first_devices, model_mesh
from jphantom.models.ffn import FFNConfig
from jphantom.pipeline.runner import PipelineConfig, pipeline_for
from jphantom.step import (abstract_params, check_step_options, make_train_step,
                           optimizer_state_specs)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What to compile: a strategy's training step of the FFN (``model="ffn"``: ``width``,
    ``depth``; ``batch`` rows of ``width`` features) or of the GPT transformer
    (``model="transformer"``: ``layers``, ``hidden``, ``heads``, ``seq_len``, ``vocab``,
    ``sequence_parallel``; ``batch`` sequences of ``seq_len`` tokens) on a mesh.

    ``mesh`` is a mesh string (``"data=2,model=4"``); the default is ``model=<num_shards>``
    (``dense`` runs on ``model=1``, the default ``num_shards``). With a mesh, ``num_shards`` becomes its ``model`` size (give one
    or the other, or both consistently). ``ghost_width`` is used by the phantom strategies only.

    A ``stage=P`` axis in ``mesh`` pipelines the step: ``schedule`` (``gpipe``, ``1f1b``,
    ``interleaved-1f1b``), ``microbatches`` per step and data rank (default ``P``),
    ``virtual_stages`` (interleaved only). Without a stage axis they must keep their defaults.

    ``zero``: the ZeRO stage of the ``data`` axis (:mod:`jphantom.sharding.zero`); ``accumulate``:
    gradient-accumulation micro-batches per step (the per-data-rank batch must be a multiple;
    pipelines accumulate through ``microbatches``); ``optimizer``: ``sgd`` (no state), ``adam`` or
    ``adamw`` (two moments per parameter).
    """

    strategy: str
    width: int
    depth: int
    batch: int
    num_shards: int = 1
    ghost_width: int | None = None
    dtype: str = "float32"
    mesh: str | None = None
    model: str = "ffn"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq_len: int = 128
    vocab: int = 256
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 1
    zero: int = 0
    accumulate: int = 1
    optimizer: str = "sgd"
    precision: str = "float32"
    remat: str = "none"
    moe_every: int = 0  # transformer: every n-th block a mixture of experts
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    dropless: bool = False
    dtd: bool = False
    cac: bool = False

    def __post_init__(self):
        strategy = strategies.get(self.strategy)
        if self.model not in ("ffn", "transformer"):
            raise ConfigError(f"model={self.model!r}; use 'ffn' or 'transformer'")
        for name in ("width", "depth", "batch", "num_shards", "layers", "hidden", "heads",
                     "seq_len", "vocab"):
            check_int(name, getattr(self, name))
        mesh = self.mesh_config()
        object.__setattr__(self, "num_shards", mesh.size("model"))
        if strategy.family != "phantom":
            object.__setattr__(self, "ghost_width", None)
        strategies.check_batch(mesh, self.batch, self.model,
                               moe=bool(self.moe_every or self.dtd))
        from jphantom.remat import with_cac
        object.__setattr__(self, "remat", with_cac(self.remat, self.cac))
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r}; use one of {tuple(OPTIMIZERS)}")
        check_int("zero", self.zero, 0)
        self.pipeline_config()  # the batch against the micro-batches, before any compile
        program = self.program()  # the strategy validates the shapes (and the ZeRO stage)
        check_step_options(program, self.batch, accumulate=self.accumulate,
                           precision=self.precision, remat=self.remat)

    def mesh_config(self) -> MeshConfig:
        return model_mesh(self.mesh, self.num_shards)

    def model_config(self):
        if self.model == "transformer":
            from jphantom.models.transformer import TransformerConfig, moe_fields
            return TransformerConfig(
                vocab_size=self.vocab, seq_len=self.seq_len, hidden=self.hidden, heads=self.heads,
                layers=self.layers, ghost_width=self.ghost_width, dtype=self.dtype,
                tied_head=strategies.get(self.strategy).family != "phantom",
                **moe_fields(self.moe_every, self.experts, self.top_k, self.capacity_factor,
                             self.dropless))
        return FFNConfig(width=self.width, depth=self.depth, ghost_width=self.ghost_width,
                         dtype=self.dtype)

    def batch_shapes(self):
        if self.model == "transformer":
            return [((self.batch, self.seq_len), "int32")] * 2
        return [((self.batch, self.width), self.dtype)] * 2

    def pipeline_config(self) -> PipelineConfig | None:
        """The pipeline on a mesh with a ``stage`` axis, else ``None`` (then the pipeline fields
        must keep their defaults); checks the per-data-rank batch against the micro-batches."""
        return pipeline_for(self.mesh_config(), self.batch, schedule=self.schedule,
                            microbatches=self.microbatches, virtual_stages=self.virtual_stages)

    def program(self):
        return strategies.get(self.strategy).program(self.model_config(), self.mesh_config(),
                                                     sequence_parallel=self.sequence_parallel,
                                                     pipeline=self.pipeline_config(),
                                                     zero=self.zero, dtd=self.dtd)

    def optimizer_transform(self) -> optax.GradientTransformation:
        return OPTIMIZERS[self.optimizer]()


# The optimizers inspect compiles (the learning rates do not change what is compiled).
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-3),
              "adamw": lambda: optax.adamw(1e-3)}


def normalise_collectives(found):
    """``found`` with :func:`normalise_replica_groups` applied to every collective's groups, so
    that ``hlo.summarize(found, axes=...)`` can map GSPMD's collectives onto mesh axes too."""
    return [dataclasses.replace(c, replica_groups=normalise_replica_groups(c.replica_groups))
            for c in found]


def compile_step(spec: StepSpec, optimizer: optax.GradientTransformation | None = None):
    """Lower and compile the training step of ``spec`` (``jphantom.step.make_train_step``, default
    optimizer ``spec.optimizer``, SGD unless set) on abstract parameters; returns
    ``(compiled, seconds_to_compile)``."""
    program, mesh = _program_and_mesh(spec)
    compiled, seconds = _compile(program, mesh, spec, optimizer or spec.optimizer_transform())
    return compiled, seconds


def _program_and_mesh(spec: StepSpec):
    program = spec.program()  # validates the shapes before any device is asked for
    mesh_config = program.mesh  # a pipeline adds model=1 where the mesh has no model axis
    return program, mesh_config.build(first_devices(mesh_config.device_count))


def _abstract_state(program, mesh, optimizer):
    """Abstract parameters and optimizer state, each leaf with its sharding (the optimizer's
    moments follow ``program.state_specs``: ZeRO-sharded for zero >= 1)."""
    params = abstract_params(program, mesh)
    shapes = jax.eval_shape(lambda: params)
    opt_specs = optimizer_state_specs(optimizer, shapes, program.state_specs)
    opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             jax.eval_shape(optimizer.init, shapes),
                             program.shardings(mesh, opt_specs))
    return params, opt_state


def _compile(program, mesh, spec: StepSpec, optimizer):
    params, opt_state = _abstract_state(program, mesh, optimizer)
    batch = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=s)
                  for (shape, dtype), s in zip(spec.batch_shapes(), program.batch_shardings(mesh)))
    step = make_train_step(program, mesh, optimizer, accumulate=spec.accumulate,
                           precision=spec.precision, remat=spec.remat)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, *batch).compile()
    return compiled, time.perf_counter() - start


def xla_flops(compiled) -> float:
    """FLOPs of a compiled executable as XLA's ``cost_analysis()`` counts them (per device for an
    SPMD program; element-wise work included). XLA counts the body of a ``while`` loop once,
    whatever its trip count, so for layers under ``lax.scan`` this undercounts: use
    :func:`gemm_flops` for a step's FLOPs."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def gemm_flops(compiled) -> int:
    """GEMM FLOPs per device of a compiled executable, every ``dot`` counted as many times as its
    loop runs (``hlo.dot_flops``; 2 per multiply-add, element-wise work left out)."""
    return dot_flops(compiled.as_text())[0]


_MEMORY_FIELDS = ("argument", "output", "temp", "alias", "generated_code")


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device bytes from ``compiled.memory_analysis()``: ``temp_bytes`` (XLA's scratch: the
    activations, residuals and buffers live during the step), ``argument_bytes`` (parameters,
    optimizer state, batch), ``output_bytes``, ``alias_bytes`` (outputs sharing an argument's
    buffer) and ``generated_code_bytes``; also under XLA's own names (``temp_size_in_bytes``...).
    Empty where the backend reports nothing."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    values = {field: int(getattr(stats, f"{field}_size_in_bytes", 0)) for field in _MEMORY_FIELDS}
    return ({f"{field}_bytes": value for field, value in values.items()}
            | {f"{field}_size_in_bytes": value for field, value in values.items()})


def per_device_bytes(structs) -> int:
    """Bytes one device holds of a tree of sharded abstract arrays: per leaf, its shard's size
    (``sharding.shard_shape``) times its item size."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(structs))


def state_bytes(program, mesh, optimizer) -> dict[str, int]:
    """Per-device bytes of the training state from its shardings: ``params_bytes``,
    ``gradient_bytes`` (the gradients the optimizer sees: the parameters' layout for ZeRO 0 and 1,
    whose all-reduce leaves the whole gradient on every data rank, ``program.state_specs`` for
    ZeRO 2 and 3), ``optimizer_bytes`` (the optimizer's state: 0 for SGD) and ``zero``."""
    params, opt_state = _abstract_state(program, mesh, optimizer)
    grad_specs = program.state_specs if program.zero >= 2 else program.param_specs
    grads = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         jax.eval_shape(lambda: params), program.shardings(mesh, grad_specs))
    out = {"params_bytes": per_device_bytes(params), "gradient_bytes": per_device_bytes(grads),
           "optimizer_bytes": per_device_bytes(opt_state), "zero": program.zero}
    out["model_state_bytes"] = sum(out[k] for k in ("params_bytes", "gradient_bytes",
                                                    "optimizer_bytes"))
    out.update(zero_formula_bytes(program, mesh, params, opt_state))
    return out


def zero_formula_bytes(program, mesh, params, opt_state) -> dict[str, float]:
    """ZeRO's model-state bytes per device for Adam (seed 001 Sec. 1.4, Table 1), with P the
    parameters per model-parallel rank (the ``data`` axis aside) and N the data-parallel degree:
    seed 001's mixed-precision figures (2-byte parameters and gradients, 12 bytes of float32
    master weights and moments): 16P, 4P + 12P/N, 2P + 14P/N, 16P/N; and jphantom's, whose float32
    parameters are the master weights (no separate copy: the compute dtype is a cast inside the
    step): 4P parameters + 4P gradients + 8P moments = 16P, 8P + 8P/N, 4P + 12P/N, 16P/N. Only
    meaningful for Adam-like optimizers (two moments)."""
    n = mesh.shape.get("data", 1)
    per_rank = sum(math.prod(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(params))
    p = per_rank * (n if program.zero == 3 else 1)  # the parameters a rank holds without ZeRO-3
    seed001 = {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}
    ours = {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}
    return {"model_state_formula_bytes": ours[program.zero],
            "seed001_formula_bytes": seed001[program.zero], "data_parallel": n,
            "params_per_model_rank": p}


def inspect_step(spec: StepSpec) -> dict:
    """Report for one strategy: ``collectives`` (rows ``{kind, axes, count, bytes}`` per collective
    kind and mesh axes, loop trip counts applied), ``collective_bytes`` (per device, whole step),
    ``collective_ops`` (every op with its shapes, groups, axes and executions per step), ``flops``
    (GEMM FLOPs per device, loops counted by trip count: :func:`gemm_flops`), ``xla_flops`` (XLA's
    ``cost_analysis()``: element-wise work included, loop bodies counted once), ``params``
    (weights), ``memory`` (:func:`compiled_memory`: ``temp_bytes``, ``argument_bytes``, ``output_bytes``,
    ``alias_bytes``..., and from the shardings :func:`state_bytes`: ``params_bytes``,
    ``gradient_bytes``, ``optimizer_bytes``, ``zero``), compile time, and on a mesh with a
    ``stage`` axis ``pipeline`` (schedule, micro-batches, virtual stages, stages)."""
    program, mesh = _program_and_mesh(spec)
    optimizer = spec.optimizer_transform()
    compiled, compile_seconds = _compile(program, mesh, spec, optimizer)
    found = normalise_collectives(collectives(compiled.as_text()))
    axes = dict(mesh.shape)
    report = {
        "strategy": spec.strategy,
        "mesh": str(spec.mesh_config()),
        "config": dataclasses.asdict(spec),
        "collectives": [row | {"axes": list(row["axes"])} for row in summarize(found, axes=axes)],
        "collective_bytes": sum(c.total_bytes for c in found if not c.trivial),
        "collective_ops": [
            {"kind": c.kind, "shapes": [[d, list(s)] for d, s in c.shapes], "bytes": c.bytes,
             "count": c.count, "axes": list(c.mesh_axes(axes)), "replica_groups": c.replica_groups}
            | ({"source_target_pairs": c.source_target_pairs}
               if c.kind == "collective-permute" else {})
            for c in found
        ],
        "flops": gemm_flops(compiled),
        "xla_flops": xla_flops(compiled),
        "params": program.param_count,
        "memory": compiled_memory(compiled) | state_bytes(program, mesh, optimizer),
        "compile_seconds": compile_seconds,
    }
    pipeline = _pipeline(program)
    if pipeline is not None:
        report["pipeline"] = pipeline
    return report


def _pipeline(program) -> dict | None:
    pipeline = program.options.get("pipeline")
    if pipeline is None:
        return None
    return {"schedule": pipeline["schedule"], "microbatches": pipeline["microbatches"],
            "virtual_stages": pipeline["virtual_stages"], "stages": program.options["stages"]}


def _state_megabytes(report: dict) -> float:
    memory = report["memory"]
    return sum(memory.get(key, 0) for key in ("params_bytes", "gradient_bytes",
                                              "optimizer_bytes")) / 1e6


def format_report(reports: list[dict]) -> str:
    """Side-by-side table of several :func:`inspect_step` reports (``state MB``: parameters,
    gradients and optimizer state per device, :func:`state_bytes`)."""
    lines = []
    mesh_width = max([16, *(len(r["mesh"]) + 2 for r in reports)])
    kind_width = max([16, *(len(op["kind"]) + 2 for r in reports for op in r["collective_ops"])])
    header = (f"{'strategy':<16}{'mesh':<{mesh_width}}{'params':>12}{'GFLOP/dev':>11}"
              f"{'coll. MB/dev':>13}{'temp MB':>9}{'state MB':>10}  collectives (executions x "
              "kind [mesh axes])")
    lines.append(header)
    lines.append("-" * (len(header) + 10))
    for r in reports:
        colls = ", ".join(f"{c['count']}x {c['kind']} [{','.join(c['axes'])}] "
                          f"({c['bytes'] / 1e6:.3f} MB)" for c in r["collectives"])
        lines.append(
            f"{r['strategy']:<16}{r['mesh']:<{mesh_width}}{r['params']:>12,}"
            f"{r['flops'] / 1e9:>11.3f}{r['collective_bytes'] / 1e6:>13.3f}"
            f"{r['memory'].get('temp_bytes', 0) / 1e6:>9.1f}{_state_megabytes(r):>10.2f}"
            f"  {colls or 'none'}"
        )
    lines.append("")
    lines.append("Per collective op (result shape per device, executions per step):")
    for r in reports:
        for op in r["collective_ops"]:
            shapes = " + ".join(f"{d}{s}" for d, s in op["shapes"])
            peers = (f"pairs={op['source_target_pairs']}" if "source_target_pairs" in op
                     else f"groups={op['replica_groups']}")
            lines.append(f"  {r['strategy']:<16}{op['kind']:<{kind_width}}{shapes:<28}"
                         f"{op['bytes']:>12,} B x{op['count']:<4} [{','.join(op['axes'])}]"
                         f"  {peers}")
    return "\n".join(lines)


def breakdown(spec: StepSpec, *, steps: int = 5, warmup: int = 2) -> dict:
    """Seed 001's bottom-up breakdown of one step (Sec. 3.1, Eqs. 2-4): the median time of the
    step (``t_iter``) and of the same step compiled without its data-parallel reductions
    (``t_compute``: :func:`jphantom.step.make_train_step` with ``communicate=False``), measured side
    by side; ``t_comm = t_iter - t_compute`` and the shares ``r_compute``, ``r_comm``; and the Eq. 26
    cost (seed 000 Table III, Frontier) of the step's collectives over ``data``, modelled. Only the
    ``data`` reductions are removed: collectives over ``model`` stay in ``t_compute``. Needs a per-rank
    strategy without ZeRO; it initialises and runs the step (unlike the rest of ``inspect``)."""
    from jphantom.analysis.timing import Runner, time_round_robin
    from jphantom.perf.comm_model import FRONTIER
    from jphantom.step import init_params
    from jphantom.train import init_optimizer_state

    program, mesh = _program_and_mesh(spec)
    if not program.manual or program.zero:
        raise ConfigError("the breakdown compiles the step without its data reductions: use a "
                          "per-rank strategy (tensor or phantom) with --zero 0")
    optimizer = spec.optimizer_transform()
    rng = np.random.default_rng(0)
    batch = []
    for (shape, dtype), sharding in zip(spec.batch_shapes(), program.batch_shardings(mesh)):
        data = (rng.integers(0, spec.vocab, shape) if np.issubdtype(np.dtype(dtype), np.integer)
                else rng.standard_normal(shape))
        batch.append(jax.device_put(np.asarray(data, dtype), sharding))
    runners = []
    for label, communicate in (("step", True), ("compute", False)):
        params = init_params(program, mesh, jax.random.PRNGKey(0))
        state = init_optimizer_state(program, mesh, optimizer, params)
        step = make_train_step(program, mesh, optimizer, accumulate=spec.accumulate,
                               precision=spec.precision, remat=spec.remat,
                               communicate=communicate)
        runners.append(Runner(label, step.lower(params, state, *batch).compile(),
                              (params, state, *batch), threads_state=True, flops_per_device=0,
                              devices=mesh.size))
    times = time_round_robin(runners, steps, warmup)
    t_iter, t_compute = times["step"], times["compute"]
    t_comm = max(t_iter - t_compute, 0.0)
    n = mesh.shape.get("data", 1)
    compiled = runners[0].compiled
    over_data = [c for c in normalise_collectives(collectives(compiled.as_text()))
                 if c.mesh_axes(dict(mesh.shape)) == ("data",)]
    modelled = FRONTIER.step_time_us(over_data, n) * 1e-6 if n > 1 and over_data else 0.0
    return {"t_iter": t_iter, "t_compute": t_compute, "t_comm": t_comm,
            "r_compute": t_compute / t_iter, "r_comm": t_comm / t_iter,
            "t_comm_eq26_frontier_modelled": modelled, "data": n, "steps": steps}
