"""The registry of parallel strategies: the choice of parallel layer is data, not an ``if``.

One vocabulary of names, shared by the CLI, the Python API, ``results.json``, the cost model and
the docs:

===================  =====================================================  ===========  ==========
name                 what runs                                              models       module
===================  =====================================================  ===========  ==========
``dense``            the unsharded model on one device (the oracle)         ffn, trans.  dense
``gspmd``            the dense model with ``NamedSharding`` annotations;    ffn, trans.  dense,
                     ``jax.jit`` chooses the collectives (what a JAX user                transformer
                     writes without jphantom)
``tensor``           Megatron tensor parallelism: column/row pairs with     ffn, trans.  tensor,
                     f and g (seed 002); ``sequence_parallel=True`` adds                 tensor_tr.
                     Megatron-SP (seed 003) in the transformer
``tensor-t1``        seed 000's TP: row-sharded weights, all-gather         ffn          tensor
                     forward / reduce-scatter backward
``phantom``          phantom parallelism (seed 000), fused decompressor     ffn, trans.  phantom,
                                                                                         phantom_tr.
``phantom-unfused``  phantom with the paper's p-1 decompressor GEMMs        ffn, trans.  phantom
``pmm3d``            AxoNN's 3D parallel matrix multiply on ``x``, ``y``,   ffn, trans.  pmm3d
                     ``z`` and ``data`` (seed 004 ch. 5, Algorithm 3)
``pmm3d-regather``   pmm3d re-gathering weights in the backward (AxoNN's)   ffn          pmm3d
``pmm3d-deferred``   pmm3d gathering every weight before the layers, one    ffn          pmm3d
                     reduce-scatter after the backward
===================  =====================================================  ===========  ==========

Transformers with MoE blocks (``moe_every``) add the ``expert`` axis to ``tensor`` (TED) and
``phantom`` (phantom-parallel experts): :mod:`jphantom.sharding.expert`.

A strategy is an object implementing :class:`Strategy`: given a model configuration and a mesh it
returns a :class:`jphantom.step.Program` (parameters, their specs, the per-rank loss), and it
reports the collectives one step performs (:meth:`Strategy.collective_inventory`), which the cost
model uses instead of branching on names. Adding a strategy touches one module and one
:func:`register` line.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig
from jphantom.models.ffn import FFNConfig, mse
from jphantom.sharding import dense, phantom, tensor
from jphantom.pipeline.runner import PipelineConfig, Stages, pipelined
from jphantom.step import Program

MODELS = ("ffn", "transformer")
FEATURE_AXIS = "model"
DATA_AXIS = "data"
STAGE_AXIS = "stage"
EXPERT_AXIS = "expert"


@runtime_checkable
class Strategy(Protocol):
    """What every parallel strategy provides."""

    name: str
    description: str
    family: str  # "dense": dense-shaped weights, any degree; "phantom": p is part of the model
    models: tuple[str, ...]

    def program(self, model_config, mesh: MeshConfig, **options) -> Program:
        """The model under this strategy on ``mesh``; raises ConfigError for what cannot run."""

    def collective_inventory(self, model_config, mesh: MeshConfig, batch: int,
                             **options) -> dict[str, list[int]]:
        """Per-device result elements of each collective kind in one training step."""


def _only_axes(mesh: MeshConfig, allowed: tuple[str, ...], strategy: str) -> None:
    extra = [name for name, size in mesh.axes if name not in allowed and size > 1]
    if extra:
        raise ConfigError(f"strategy {strategy!r} runs on mesh axes {allowed}, not {extra}: "
                          f"drop them from the mesh ({mesh})")


def _data_spec(mesh: MeshConfig):
    return DATA_AXIS if DATA_AXIS in mesh.shape else None


def _check_batch_axes(mesh: MeshConfig, strategy: str, model_axis: bool = True,
                      expert_axis: bool = False) -> None:
    allowed = (DATA_AXIS, STAGE_AXIS, FEATURE_AXIS) if model_axis else (DATA_AXIS,)
    _only_axes(mesh, allowed + ((EXPERT_AXIS,) if expert_axis else ()), strategy)


def check_batch(mesh: MeshConfig, batch: int, model: str, *, moe: bool = False) -> None:
    """Before building anything: the global ``batch`` against the ranks that split it (``data``,
    ``expert``, pmm3d's ``z``), and MoE options only on the transformer."""
    ranks = mesh.size(DATA_AXIS) * mesh.size(EXPERT_AXIS) * mesh.size("z")
    if batch % ranks:
        raise ConfigError(f"batch={batch} is not divisible by the data axis (times the expert and "
                          f"z axes): {ranks} ranks of mesh {mesh} split the batch; pick a multiple")
    if moe and model != "transformer":
        raise ConfigError("--moe-every and --dtd apply to --model transformer")


def _batch_axes(mesh: MeshConfig) -> tuple[str, ...]:
    """The axes splitting the transformer's batch: ``data``, and ``expert`` (MoE models run their
    dense blocks data-parallel over it)."""
    return tuple(a for a in (DATA_AXIS, EXPERT_AXIS) if a in mesh.shape)


@dataclasses.dataclass(frozen=True)
class _Base:
    name: str
    description: str
    family: str
    models: tuple[str, ...]

    def _check_model(self, model_config):
        model = getattr(model_config, "model_name", None)
        if model not in self.models:
            raise ConfigError(f"strategy {self.name!r} runs the models {self.models}, not "
                              f"{model!r}: pick one of {strategies_for(model)}")
        return model

    def program(self, model_config, mesh: MeshConfig, *, sequence_parallel: bool = False,
                pipeline: PipelineConfig | None = None, zero: int = 0,
                dtd: bool = False) -> Program:
        """``pipeline``: the schedule when the mesh has a ``stage`` axis (default: 1F1B with one
        micro-batch per stage). A staged mesh without a ``model`` axis gets ``model=1``: build the
        jax mesh from ``program.mesh``. ``zero``: the ZeRO stage of the ``data`` axis
        (:mod:`jphantom.sharding.zero`). ``dtd``: duplicate token dropping in the MoE blocks of a
        transformer under ``tensor`` (seed 004 ch. 7)."""
        from jphantom.sharding import zero as zero_module

        zero_module.check(zero)  # before building anything
        if zero and EXPERT_AXIS in MeshConfig.of(mesh).shape:
            raise ConfigError("ZeRO shards over 'data' only and cannot yet reduce the non-expert "
                              "gradients over the 'expert' axis too: use zero=0 with an expert "
                              "axis, or put all ranks on 'data'")
        return zero_module.apply(
            self._program(model_config, mesh, sequence_parallel, pipeline, dtd), zero)

    def _program(self, model_config, mesh, sequence_parallel, pipeline, dtd=False) -> Program:
        model = self._check_model(model_config)
        mesh = MeshConfig.of(mesh)
        moe = getattr(model_config, "moe", None)
        if dtd and (moe is None or self.name != "tensor"):
            raise ConfigError("dtd (duplicate token dropping) applies to the MoE blocks of a "
                              "transformer under strategy 'tensor' (TED): set moe_every and use "
                              "'tensor', or leave dtd out")
        if EXPERT_AXIS in mesh.shape and moe is None:
            raise ConfigError(f"an {EXPERT_AXIS!r} mesh axis splits the experts of MoE blocks: "
                              "give the transformer MoE blocks (--moe-every 2 --experts 8) or drop "
                              "the axis")
        if moe is not None and STAGE_AXIS in mesh.shape:
            raise ConfigError("MoE blocks do not run inside pipeline stages yet: drop the 'stage' "
                              "axis or set moe_every=0")
        if moe is not None and sequence_parallel:
            raise ConfigError("MoE blocks run on the replicated stream: sequence_parallel with "
                              "moe_every is not implemented; leave one of them out")
        if sequence_parallel and (model != "transformer" or self.name != "tensor"):
            raise ConfigError("sequence_parallel applies to the transformer under strategy "
                              f"'tensor' (Megatron-SP), not to {model} under {self.name!r}")
        if pipeline is not None and not isinstance(pipeline, PipelineConfig):
            raise ConfigError(f"pipeline={pipeline!r} must be a jphantom.pipeline.runner."
                              "PipelineConfig")
        staged = STAGE_AXIS in mesh.shape
        if pipeline is not None and not staged:
            raise ConfigError(f"a pipeline needs a 'stage' axis in the mesh, got {mesh}: e.g. "
                              "'stage=4,data=2,model=1'")
        if staged and self.name in ("dense", "gspmd"):
            raise ConfigError(f"strategy {self.name!r} does not run inside pipeline stages: use "
                              "'tensor' or 'phantom' (with model=1 for no tensor parallelism)")
        if staged and FEATURE_AXIS not in mesh.shape:  # stages without tensor parallelism
            mesh = MeshConfig.of({**dict(mesh.axes), FEATURE_AXIS: 1})
        if model == "ffn":
            program = self._ffn_program(model_config, mesh)
        else:
            program = _transformer_program(self, model_config, mesh, sequence_parallel, dtd)
        if staged:
            return pipelined(program, pipeline or PipelineConfig(microbatches=mesh.size(STAGE_AXIS)))
        return program

    def collective_inventory(self, model_config, mesh, batch, **options):
        model = self._check_model(model_config)
        if model == "ffn":
            return self._ffn_collectives(model_config, MeshConfig.of(mesh), batch)
        return _transformer_collectives(self, model_config, MeshConfig.of(mesh), batch, **options)


def _squared_error(y, t):
    """This rank's sum of squared errors, reduced in at least float32."""
    wide = jnp.promote_types(y.dtype, jnp.float32)
    return jnp.sum(jnp.square(y.astype(wide) - t.astype(wide)))


def _relu_between(x, chunk):
    """The FFN's ReLU between layers, at a pipeline chunk's entry (none before layer 0)."""
    return jnp.where(chunk > 0, jax.nn.relu(x), x)


def _feature_stages(config: FFNConfig, mesh: MeshConfig, stacked_units: int, unit_name: str,
                    body, first=lambda x: x, last=lambda y: y) -> Stages:
    """An FFN cut for pipelining: every parameter is stacked; the first chunk takes the input x
    (through ``first``), the last applies ``last`` and the mean squared error."""
    data = mesh.size(DATA_AXIS)

    def loss(_, y, t, microbatches):
        return _squared_error(last(y), t) / (t.shape[0] * microbatches * data * config.width)

    return Stages(units=stacked_units, unit_name=unit_name, split=lambda params: (params, {}),
                  join=lambda stacked, rest: stacked, first=lambda _, x: first(x),
                  body=lambda chunk, x, c: body(chunk, _relu_between(x, c)), last=loss)


def _feature_program(name, config: FFNConfig, mesh: MeshConfig, *, init, specs, per_rank,
                     dense_equivalent, param_count, stages: Stages | None = None) -> Program:
    """An FFN whose activations are sharded on features over ``model`` and batch over ``data``."""
    _check_batch_axes(mesh, name)
    p = mesh.size(FEATURE_AXIS)
    data = _data_spec(mesh)
    batch_spec = P(data, FEATURE_AXIS if FEATURE_AXIS in mesh.shape else None)
    total = mesh.size(DATA_AXIS)
    axis = FEATURE_AXIS

    def loss(params, x, t):
        return _squared_error(per_rank(params, x, axis=axis), t) / (
            x.shape[0] * total * config.width)

    if FEATURE_AXIS not in mesh.shape:
        raise ConfigError(f"strategy {name!r} shards features over the 'model' axis: add it to the "
                          f"mesh (e.g. 'model={jax.device_count()}'), got {mesh}")
    return Program(
        strategy=name, model="ffn", mesh=mesh, init=init, param_specs=specs,
        batch_specs=(batch_spec, batch_spec), loss=loss, manual=True,
        loss_partial_axes=(FEATURE_AXIS,), dense_equivalent=dense_equivalent,
        forward=lambda params, x: per_rank(params, x, axis=axis), output_spec=batch_spec,
        param_count=param_count, options={"num_shards": p}, stages=stages)


@dataclasses.dataclass(frozen=True)
class DenseStrategy(_Base):
    """``dense`` (one device) and ``gspmd`` (NamedSharding annotations, jit's collectives)."""

    annotated: bool = False

    def _ffn_program(self, config: FFNConfig, mesh: MeshConfig, **options) -> Program:
        dtype = jnp.dtype(config.dtype)
        init = lambda key: dense.init(key, width=config.width, depth=config.depth, dtype=dtype)
        count = dense.param_count(config.width, config.depth)
        if not self.annotated:
            if mesh.device_count != 1:
                raise ConfigError(f"strategy 'dense' runs on one device, not on mesh {mesh}: use "
                                  "'model=1', or 'gspmd' / 'tensor' / 'phantom' for several devices")
            return Program("dense", "ffn", mesh, init, {"weight": P(), "bias": P()}, (P(), P()),
                           lambda params, x, t: mse(dense.forward(params, x), t),
                           manual=False, dense_equivalent=lambda params: params,
                           forward=dense.forward, output_spec=P(), param_count=count)
        _check_batch_axes(mesh, self.name)
        axis = FEATURE_AXIS if FEATURE_AXIS in mesh.shape else None
        activation = P(_data_spec(mesh), axis)
        specs = dense.gspmd_specs(axis)

        def forward_on(mesh_obj):  # GSPMD needs the concrete mesh for its sharding constraints
            return lambda params, x: dense.gspmd_forward(params, x, mesh_obj, activation)

        def loss_on(mesh_obj):
            return lambda params, x, t: mse(forward_on(mesh_obj)(params, x), t)

        return Program("gspmd", "ffn", mesh, init, specs, (activation, activation), loss_on,
                       manual=False, binds_mesh=True, dense_equivalent=lambda params: params,
                       forward=forward_on, output_spec=activation, param_count=count)

    def _ffn_collectives(self, config, mesh, batch):
        raise ConfigError(f"strategy {self.name!r} has no hand-written collectives to list: "
                          "inspect its compiled step instead (jphantom inspect)")


@dataclasses.dataclass(frozen=True)
class TensorStrategy(_Base):
    layout: str = "megatron"  # or "t1"

    def _ffn_program(self, config: FFNConfig, mesh: MeshConfig, **options) -> Program:
        p = mesh.size(FEATURE_AXIS)
        from jphantom.sharding._common import check_width
        check_width(config.width, p)
        dtype = jnp.dtype(config.dtype)
        dense_init = lambda key: dense.init(key, width=config.width, depth=config.depth, dtype=dtype)
        axis = FEATURE_AXIS
        if self.layout == "t1":
            return _feature_program(
                self.name, config, mesh, init=dense_init, specs=tensor.t1_specs(FEATURE_AXIS),
                per_rank=tensor.t1_per_rank, dense_equivalent=lambda params: params,
                param_count=dense.param_count(config.width, config.depth),
                stages=_feature_stages(config, mesh, config.depth, "depth",
                                       lambda chunk, x: tensor.t1_per_rank(chunk, x, axis=axis)))
        stages = None
        if STAGE_AXIS in mesh.shape and config.depth % 2:
            raise ConfigError(f"pipelined Megatron FFN stages hold whole (column, row) layer "
                              f"pairs: depth={config.depth} must be even")
        if config.depth % 2 == 0:  # whole pairs: pipelines and ZeRO-3's per-layer gather
            stages = _feature_stages(
                config, mesh, config.depth // 2, "layer pairs (depth / 2)",
                lambda chunk, x: tensor.megatron_pairs(chunk, x, axis=axis),
                first=partial(tensor.gather_from_model_parallel, axis),
                last=partial(tensor.scatter_to_model_parallel, axis))
        return _feature_program(
            self.name, config, mesh, init=lambda key: tensor.megatron_from_dense(dense_init(key)),
            specs=tensor.megatron_specs(FEATURE_AXIS), per_rank=tensor.megatron_per_rank,
            dense_equivalent=tensor.megatron_dense_equivalent,
            param_count=dense.param_count(config.width, config.depth), stages=stages)

    def _ffn_collectives(self, config, mesh, batch):
        return tensor.collective_buffers(width=config.width, num_shards=mesh.size(FEATURE_AXIS),
                                         depth=config.depth, batch=batch, layout=self.layout)


@dataclasses.dataclass(frozen=True)
class PhantomStrategy(_Base):
    fused: bool = True

    def _ffn_program(self, config: FFNConfig, mesh: MeshConfig, **options) -> Program:
        p = mesh.size(FEATURE_AXIS)
        if config.ghost_width is None:
            raise ConfigError(f"strategy {self.name!r} needs ghost_width (k of seed 000), e.g. "
                              "--ghost-width 16")
        phantom.PhantomConfig(config.width, config.ghost_width, p, config.depth)
        dtype = jnp.dtype(config.dtype)
        init = lambda key: phantom.init(key, width=config.width, ghost_width=config.ghost_width,
                                        num_shards=p, depth=config.depth, dtype=dtype)
        return _feature_program(
            self.name, config, mesh, init=init, specs=phantom.linear_specs(FEATURE_AXIS),
            per_rank=partial(phantom.ffn_per_rank, fused=self.fused),
            dense_equivalent=phantom.dense_equivalent,
            param_count=phantom.param_count(config.width, config.ghost_width, p, config.depth),
            stages=_feature_stages(config, mesh, config.depth, "depth", lambda chunk, x: (
                phantom.ffn_per_rank(chunk, x, axis=FEATURE_AXIS, fused=self.fused))))

    def _ffn_collectives(self, config, mesh, batch):
        return phantom.collective_buffers(width=config.width, ghost_width=config.ghost_width,
                                          num_shards=mesh.size(FEATURE_AXIS), depth=config.depth,
                                          batch=batch)


def _divides(what: str, value: int, p: int, fix: str) -> None:
    if value % p:
        raise ConfigError(f"{what}={value} is not divisible by the model axis size {p}: {fix}")


def _transformer_program(strategy, config, mesh: MeshConfig, sequence_parallel: bool,
                         dtd: bool = False) -> Program:
    """The GPT transformer (:mod:`jphantom.models.transformer`) under ``strategy`` on ``mesh``:
    tokens and targets [B, S] split over ``data`` (and ``expert``: MoE models); the loss is the
    mean next-token cross-entropy (plus the MoE auxiliary losses)."""
    from jphantom.models import transformer as tr
    from jphantom.sharding import phantom_transformer

    batch_axes = _batch_axes(mesh)
    pmm3d_grid = strategy.name.startswith("pmm3d")
    rows = batch_axes + ((PMM3D_DEPTH,) if pmm3d_grid else ())  # z splits the rows too
    data = rows[0] if len(rows) == 1 else (rows or None)
    batch_spec = P(data, None)
    data_size = math.prod(mesh.size(a) for a in rows)
    expert_axis = EXPERT_AXIS if EXPERT_AXIS in mesh.shape else None
    if config.moe is not None and expert_axis:
        config.moe.check_axis(mesh.size(EXPERT_AXIS))
    dense_init = lambda key: tr.init_dense(key, config)
    count = config.param_count()
    name = strategy.name
    if name in ("dense", "gspmd"):
        if name == "dense" and mesh.device_count != 1:
            raise ConfigError(f"strategy 'dense' runs on one device, not on mesh {mesh}: use "
                              "'model=1', or 'gspmd' / 'tensor' / 'phantom' for several devices")
        _check_batch_axes(mesh, name)
        axis = FEATURE_AXIS if FEATURE_AXIS in mesh.shape else None
        specs = (tensor.transformer_specs(axis, untied_head=not config.tied_head, config=config)
                 if name == "gspmd"
                 else jax.tree.map(lambda _: P(), jax.eval_shape(dense_init, jax.random.PRNGKey(0))))

        def bind(mesh_obj, what):
            from jax.sharding import NamedSharding
            residual = NamedSharding(mesh_obj, P(data, None, None))
            constrain = ((lambda h: jax.lax.with_sharding_constraint(h, residual))
                         if name == "gspmd" else (lambda h: h))
            layers = dense.TransformerLayers(config.layer_norm_eps, constrain)
            if what == "loss":
                return lambda params, tokens, targets: tr.loss_sum(
                    layers, config, params, tokens, targets) / targets.size
            if what == "metrics":
                return lambda params, tokens, targets: _mean_cross_entropy(
                    tr.loss_and_metrics(layers, config, params, tokens, targets)[1],
                    targets.size)
            return lambda params, tokens: tr.logits_of(layers, config, params, tokens)

        return Program(name, "transformer", mesh, dense_init, specs, (batch_spec, batch_spec),
                       lambda m: bind(m, "loss"), manual=False, binds_mesh=True,
                       dense_equivalent=lambda params: params,
                       forward=lambda m: bind(m, "logits"), output_spec=P(data, None, None),
                       param_count=count, options={"sequence_parallel": False},
                       metrics=lambda m: bind(m, "metrics"))

    if not pmm3d_grid:
        _check_batch_axes(mesh, name, expert_axis=config.moe is not None)
    p = mesh.size(FEATURE_AXIS)
    _divides("heads", config.heads, p, "every rank must hold whole attention heads; pick heads "
             "divisible by the model axis or a smaller model axis")
    _divides("vocab_size", config.vocab_size, p, "the vocabulary is split over the model axis; pad "
             "it to a multiple (jphantom.models.transformer.logits pads GPT-2's automatically)")
    if name == "tensor":
        if sequence_parallel:
            _divides("seq_len", config.seq_len, p, "sequence parallelism splits the sequence over "
                     "the model axis; pick a sequence length divisible by it")
        layers = tensor.TransformerLayers(FEATURE_AXIS, config.layer_norm_eps, sequence_parallel,
                                          expert_axis=expert_axis, batch_axes=batch_axes,
                                          dtd=dtd)
        init, specs = dense_init, tensor.transformer_specs(
            FEATURE_AXIS, untied_head=not config.tied_head, config=config, expert_axis=expert_axis)
        if not config.tied_head:
            raise ConfigError("strategy 'tensor' ties the LM head to the token embedding (GPT-2); "
                              "use tied_head=True")
        dense_equivalent = lambda params: params
    elif pmm3d_grid:
        layers, specs = _pmm3d_transformer(strategy, config, mesh)
        init, dense_equivalent = dense_init, (lambda params: params)
    else:
        if config.ghost_width is None:
            raise ConfigError(f"strategy {name!r} needs ghost_width (k ghost neurons per rank and "
                              "token, seed 000), e.g. --ghost-width 8")
        layers = phantom_transformer.TransformerLayers(
            FEATURE_AXIS, config.layer_norm_eps, config.hidden, fused=strategy.fused,
            expert_axis=expert_axis, batch_axes=batch_axes)
        init = lambda key: phantom_transformer.init(key, config, p)
        specs = phantom_transformer.specs(FEATURE_AXIS, config, expert_axis)
        dense_equivalent = phantom_transformer.dense_equivalent
        count = phantom_transformer.param_count(config, p)

    def loss(params, tokens, targets):  # this rank's share of the global mean
        return tr.loss_sum(layers, config, params, tokens, targets) / (targets.size * data_size)

    def last(rest, h, targets, microbatches):
        return layers.loss(rest, layers.norm(rest["ln_f"], h), targets) / (
            targets.size * microbatches * data_size)

    def metrics(params, tokens, targets):  # this rank's shares of the batch totals
        return _mean_cross_entropy(tr.loss_and_metrics(layers, config, params, tokens, targets)[1],
                                   targets.size * data_size)

    stages = None if config.moe is not None or pmm3d_grid else Stages(
        units=config.layers, unit_name="layers",
        split=lambda params: (params["blocks"], {k: v for k, v in params.items() if k != "blocks"}),
        join=lambda blocks, rest: {**rest, "blocks": blocks}, first=layers.embed,
        body=lambda blocks, h, _: tr.blocks(layers, config, blocks, h), last=last,
        prepare=layers.prepare)

    return Program(name, "transformer", mesh, init, specs, (batch_spec, batch_spec), loss,
                   manual=True, dense_equivalent=dense_equivalent,
                   forward=lambda params, tokens: tr.logits_of(layers, config, params, tokens),
                   output_spec=P(data, None, "x" if pmm3d_grid else FEATURE_AXIS),
                   param_count=count, loss_partial_axes=(PMM3D_DEPTH,) if pmm3d_grid else (),
                   options={"sequence_parallel": sequence_parallel, "num_shards": p, "dtd": dtd},
                   stages=stages, metrics=metrics)


def _mean_cross_entropy(metrics: dict, tokens: int) -> dict:
    return {**metrics, "cross_entropy": metrics["cross_entropy"] / tokens}


def _transformer_collectives(strategy, config, mesh: MeshConfig, batch: int, *,
                             sequence_parallel: bool = False) -> dict[str, list[int]]:
    """Per-device result elements of each collective kind in one step over the model axis
    (docstrings of :mod:`jphantom.sharding.tensor` and :mod:`.phantom_transformer`); ``batch`` is
    the per-data-rank batch. The data-parallel gradient all-reduce is not included."""
    p, L, h, s = mesh.size(FEATURE_AXIS), config.layers, config.hidden, config.seq_len
    tokens = batch * s
    if strategy.name == "tensor":
        if not sequence_parallel:
            # embedding all-reduce (fwd); per block g, g (fwd) and f, f (bwd); head f (bwd);
            # cross-entropy: max, sum of exponentials, target logit
            return {"all-reduce": [tokens * h] * (4 * L + 2) + [tokens] * 3}
        # each all-reduce of B*S*h becomes a reduce-scatter to B*S*h/p and an all-gather back;
        # plus the gradients of the sequence-parallel parameters (LayerNorms, row biases, wpe)
        sp_grads = [L * h] * 6 + [h] * 2 + [s * h]
        return {"reduce-scatter": [tokens * h // p] * (4 * L + 2),
                "all-gather": [tokens * h] * (4 * L + 2),
                "all-reduce": [tokens] * 3 + sp_grads}
    if strategy.family == "phantom":
        k = config.ghost_width
        projections = 4 * L + 1
        return {"all-gather": [tokens * p * k] * projections,
                "reduce-scatter": [tokens * k] * projections,
                "all-reduce": [tokens] * (8 * L + 4 + 3)}
    raise ConfigError(f"strategy {strategy.name!r} has no hand-written collectives to list: "
                      "inspect its compiled step instead (jphantom inspect)")


PMM3D_DEPTH = "z"
PMM3D_AXES = (DATA_AXIS, "z", "y", "x")


def _pmm3d_mesh(mesh: MeshConfig, name: str) -> MeshConfig:
    """The mesh with every one of ``x``, ``y``, ``z`` (size 1 where absent): build the jax mesh
    from ``program.mesh``."""
    _only_axes(mesh, PMM3D_AXES, name)
    return MeshConfig.of({**dict(mesh.axes), **{a: mesh.size(a) for a in ("z", "y", "x")}})


def _pmm3d_divides(what: str, value: int, axes: tuple[str, ...], mesh: MeshConfig) -> None:
    size = math.prod(mesh.size(a) for a in axes)
    if value % size:
        raise ConfigError(f"{what}={value} is not divisible by {' x '.join(axes)} = {size} of mesh "
                          f"{mesh}: pmm3d splits it over those axes; pick a multiple or another "
                          "grid")


def _pmm3d_transformer(strategy, config, mesh: MeshConfig):
    from jphantom.sharding import pmm3d

    if config.moe is not None:
        raise ConfigError("pmm3d does not run MoE blocks: use 'tensor' (TED) or 'phantom'")
    if not config.tied_head:
        raise ConfigError("pmm3d ties the LM head to the token embedding: use tied_head=True")
    if strategy.deferred or strategy.regather:
        raise ConfigError(f"{strategy.name!r} is implemented for the FFN; the transformer runs "
                          "'pmm3d' (weights gathered once per layer and kept for the backward)")
    h = config.hidden
    _pmm3d_divides("heads", config.heads, ("x",), mesh)
    for what, value in (("hidden", h), ("4 x hidden", 4 * h)):
        _pmm3d_divides(what, value, ("x", "z"), mesh)
        _pmm3d_divides(what, value, ("y", "z"), mesh)
    _pmm3d_divides("vocab_size", config.vocab_size, ("x", "z"), mesh)
    return pmm3d.TransformerLayers(config.layer_norm_eps, h), pmm3d.transformer_specs(config)


@dataclasses.dataclass(frozen=True)
class PMM3DStrategy(_Base):
    """AxoNN's 3D parallel matrix multiply on ``x``, ``y``, ``z`` (and ``data``): seed 004 ch. 5,
    :mod:`jphantom.sharding.pmm3d`."""

    regather: bool = False
    deferred: bool = False

    def program(self, model_config, mesh: MeshConfig, *, zero: int = 0, **options) -> Program:
        if zero:
            raise ConfigError(f"zero={zero}: pmm3d already shards every weight over 'z' (its "
                              "z-only grid is ZeRO-3); leave zero out and give the mesh a z axis")
        return super().program(model_config, mesh, **options)

    def _program(self, model_config, mesh, sequence_parallel, pipeline, dtd=False) -> Program:
        mesh = MeshConfig.of(mesh)
        if STAGE_AXIS in mesh.shape or pipeline is not None:
            raise ConfigError("pmm3d does not run inside pipeline stages: drop the 'stage' axis")
        if sequence_parallel:
            raise ConfigError("sequence_parallel is Megatron's (strategy 'tensor'); pmm3d splits "
                              "the tokens over 'z' instead")
        return super()._program(model_config, _pmm3d_mesh(mesh, self.name), False, None, dtd)

    def _ffn_program(self, config: FFNConfig, mesh: MeshConfig, **options) -> Program:
        from jphantom.sharding import pmm3d

        n = config.width
        for axes in (("x", "z"), ("y", "z")):
            _pmm3d_divides("width", n, axes, mesh)
        dtype = jnp.dtype(config.dtype)
        rows = tuple(a for a in (DATA_AXIS, PMM3D_DEPTH) if a in mesh.shape)
        out = pmm3d.ffn_output_axis(config.depth)
        row_spec = rows[0] if len(rows) == 1 else rows
        total = math.prod(mesh.size(a) for a in rows)
        run = partial(pmm3d.ffn_per_rank, regather=self.regather, deferred=self.deferred)

        def loss(params, x, t):
            return _squared_error(run(params, x), t) / (x.shape[0] * total * n)

        return Program(
            strategy=self.name, model="ffn", mesh=mesh,
            init=lambda key: pmm3d.ffn_split(dense.init(key, width=n, depth=config.depth,
                                                        dtype=dtype)),
            param_specs=pmm3d.ffn_specs(), batch_specs=(P(row_spec, "y"), P(row_spec, out)),
            loss=loss, manual=True, loss_partial_axes=(PMM3D_DEPTH, out),
            dense_equivalent=pmm3d.ffn_dense_equivalent, forward=run,
            output_spec=P(row_spec, out), param_count=dense.param_count(n, config.depth),
            options={"grid": {a: mesh.size(a) for a in PMM3D_AXES}})

    def _ffn_collectives(self, config, mesh, batch):
        raise ConfigError("pmm3d's collectives are Eqs. 5.1-5.5 (jphantom.perf.axonn_model); "
                          "inspect its compiled step with jphantom inspect")


REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    if not isinstance(strategy, Strategy):
        raise TypeError(f"{strategy!r} does not implement jphantom.strategies.Strategy")
    REGISTRY[strategy.name] = strategy
    return strategy


register(DenseStrategy("dense", "the unsharded model on one device (the single-device oracle)",
                       "dense", MODELS))
register(DenseStrategy("gspmd", "the dense model with NamedSharding annotations; jax.jit chooses "
                       "the collectives", "dense", MODELS, annotated=True))
register(TensorStrategy("tensor", "Megatron tensor parallelism: column/row pairs with f and g "
                        "(seed 002); sequence parallelism as an option (seed 003)", "dense", MODELS))
register(TensorStrategy("tensor-t1", "seed 000's TP: row-sharded weights, all-gather forward / "
                        "reduce-scatter backward", "dense", ("ffn",), layout="t1"))
register(PhantomStrategy("phantom", "phantom parallelism (seed 000), one fused decompressor GEMM",
                         "phantom", MODELS))
register(PhantomStrategy("phantom-unfused", "phantom parallelism with the paper's p-1 "
                         "decompressor GEMMs", "phantom", MODELS, fused=False))

register(PMM3DStrategy("pmm3d", "AxoNN's 3D parallel matrix multiply on x, y, z (and data), "
                       "seed 004 ch. 5: weights all-gathered over z, all-reduces over y forward "
                       "and x backward, reduce-scatters over z", "dense", MODELS))
register(PMM3DStrategy("pmm3d-regather", "pmm3d whose backward all-gathers the weights again "
                       "instead of keeping them (AxoNN's default; FFN)", "dense", ("ffn",),
                       regather=True))
register(PMM3DStrategy("pmm3d-deferred", "pmm3d with every weight gathered before the layers and "
                       "one reduce-scatter after the backward (FFN)", "dense", ("ffn",),
                       deferred=True))

NAMES = tuple(REGISTRY)


def get(name: str) -> Strategy:
    """Look a strategy up by name, with the list of valid names in the error."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {list(REGISTRY)}") from None


def strategies_for(model: str) -> list[str]:
    return [name for name, s in REGISTRY.items() if model in s.models]


def param_count(name: str, *, width: int, depth: int, num_shards: int = 1,
                ghost_width: int | None = None) -> int:
    """Weights of the FFN a strategy trains (biases excluded, as in Table I)."""
    from jphantom.sharding._common import check_depth, check_width
    check_width(width, num_shards)
    check_depth(depth)
    if get(name).family == "phantom":
        return phantom.param_count(width, ghost_width, num_shards, depth)
    return dense.param_count(width, depth)
