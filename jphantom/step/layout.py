"""The parameter layout of a training step and what follows from it (the first part of
:class:`jphantom.step.train_step.TrainStep`): the state the step carries (:class:`TrainState`); the model's
parameters as the step sees them, each with its mesh axes, the axes its gradient is summed over and
its ZeRO dimension (:class:`ParamLayout`); the batch's axes and specs; the checks of a mesh, a batch
and a model before anything is traced (blocks that are not stacked, dropout layers, the private
copy the step keeps).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from jphantom.step import zero as zero_module
from jphantom.errors import ConfigError, JPhantomWarning
from jphantom.runtime.mesh import BATCH_AXES
from jphantom.nn import attention as attention_module
from jphantom.nn import dropout as dropout_module
from jphantom.nn import metadata
from jphantom.nn.stack import Stacked


class TrainState(NamedTuple):
    """What the step carries: ``params`` (a nested dict of the model's parameters, global arrays in
    their shards, keyed by the model's attribute paths) and the optax state (of a SAMO step: a
    :class:`jphantom.experimental.samo.SamoState`, and ``params`` the dense theta16)."""

    params: Any
    opt_state: Any


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def path_key(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """The model's parameters as the step sees them: the ``nnx.split`` pieces, and per leaf (in
    the pure dict's order) its spec, the axes its gradient is summed over, its ZeRO dimension."""

    graphdef: Any
    state_treedef: Any
    pure_treedef: Any
    order: tuple[int, ...]  # pure leaf i is state leaf order[i]
    shapes: tuple[jax.ShapeDtypeStruct, ...]
    specs: tuple[P, ...]  # the parameters' own specs (without ZeRO)
    reduce_axes: tuple[tuple[str, ...], ...]
    zero_dims: tuple[int, ...]
    zero_axes: tuple[tuple[str, ...], ...] = ()  # per leaf: the axes ZeRO shards it over
    # per top-level Stacked: (its path, the pure indices of its block's leaves in the order of
    # jax.tree.leaves(nnx.split(stacked.block)[1])): ZeRO-3 fetches those layer by layer
    stacks: tuple[tuple[tuple, tuple[int, ...]], ...] = ()

    @property
    def stacked(self) -> frozenset[int]:
        return frozenset(i for _, indices in self.stacks for i in indices)

    @classmethod
    def of(cls, model: nnx.Module, mesh: Mesh, zero: int) -> "ParamLayout":
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            names = sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=is_variable)})
            where = next(".".join(map(str, path)) for path, v in nnx.iter_graph(model)
                         if isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param))
            raise ConfigError(f"the model holds state other than nnx.Param ({', '.join(names)}), "
                              f"e.g. at {where}; the step trains parameters only (and draws "
                              "nnx.Dropout's masks itself): remove it (batch statistics, "
                              "caches) or keep it outside the model")
        variables = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)[0]
        pure = nnx.to_pure_dict(params)
        pure_paths, pure_treedef = jax.tree_util.tree_flatten_with_path(pure)
        index = {path_key(path): i for i, (path, _) in enumerate(variables)}
        order = tuple(index[path_key(path)] for path, _ in pure_paths)
        sizes = dict(mesh.shape)
        axes = tuple(a for a in mesh.axis_names if sizes[a] > 1)  # a size-1 axis splits nothing
        pure_keys = [path_key(path) for path, _ in pure_paths]
        stacks = top_stacks(model, pure_keys)
        stacked = {i for _, indices in stacks for i in indices}
        specs, reduce, dims, shapes, zaxes = [], [], [], [], []
        for pure_index, i in enumerate(order):
            variable = variables[i][1]
            value = variable.get_value()
            spec = metadata.spec_of(variable, axes)
            specs.append(spec)
            reduce.append(tuple(a for a in metadata.reduce_axes_of(variable) if a in axes))
            shapes.append(jax.ShapeDtypeStruct(value.shape, value.dtype))
            over = zero_module.zero_axes(spec, axes) if zero else ()
            ranks = math.prod(sizes[a] for a in over)
            dims.append(zero_module.choose_dim(value.shape, spec, ranks,
                                               stacked=pure_index in stacked)
                        if over and ranks > 1 else -1)
            zaxes.append(over)
        return cls(graphdef, jax.tree.structure(params), pure_treedef, order, tuple(shapes),
                   tuple(specs), tuple(reduce), tuple(dims), tuple(zaxes), stacks)

    def check_params(self, params, where: str = "step.init") -> None:
        """A ConfigError naming what differs when ``params`` (a pure dict, as
        ``TrainState.params``) is not this model's: paths missing or not the model's, or a leaf
        of another shape (one line, before anything is copied to a device); ``where`` names the
        call that was given them."""
        def named(tree):
            leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
            return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}

        want = named(jax.tree.unflatten(self.pure_treedef, list(self.shapes)))
        given = named(params)
        missing = [k for k in want if k not in given]
        extra = [k for k in given if k not in want]
        if missing or extra:
            parts = ([f"missing {len(missing)} parameter(s) the model has ({', '.join(missing[:3])}"
                      f"{', ...' if len(missing) > 3 else ''})"] if missing else []) + (
                [f"{len(extra)} the model does not have ({', '.join(extra[:3])}"
                 f"{', ...' if len(extra) > 3 else ''})"] if extra else [])
            raise ConfigError(f"the parameters given to {where} are not the model's: "
                              f"{'; '.join(parts)}: pass the tree of the model the step was made "
                              "for (nnx.to_pure_dict(nnx.state(model, nnx.Param)))")
        if jax.tree.structure(params) != self.pure_treedef:
            raise ConfigError(f"the parameters given to {where} hold the model's names in "
                              "another tree structure: pass nnx.to_pure_dict(nnx.state(model, "
                              "nnx.Param)) of the model the step was made for")
        for key, shape in want.items():
            leaf = given[key]
            if tuple(getattr(leaf, "shape", ())) != tuple(shape.shape):
                raise ConfigError(f"parameter {key} given to {where} has shape "
                                  f"{tuple(getattr(leaf, 'shape', ()))}; the model's is "
                                  f"{tuple(shape.shape)}")

    def state_of(self, leaves):
        """An ``nnx.State`` of pure-order ``leaves`` (inside a trace: fresh Variables)."""
        ordered = [None] * len(leaves)
        for pure_index, state_index in enumerate(self.order):
            ordered[state_index] = leaves[pure_index]
        return jax.tree.unflatten(self.state_treedef, ordered)

    def model_of(self, leaves) -> nnx.Module:
        return nnx.merge(self.graphdef, self.state_of(leaves))

    def zero_specs(self) -> tuple[P, ...]:
        return tuple(zero_module.sharded_spec(s, d, a.ndim, z)
                     for s, d, a, z in zip(self.specs, self.zero_dims, self.shapes,
                                           self.zero_axes))


def module_at(model: nnx.Module, path: tuple) -> nnx.Module:
    """The submodule of ``model`` at ``path`` (attribute names and list indices)."""
    for part in path:
        model = model[part] if isinstance(part, int) else getattr(model, part)
    return model


def top_stacks(model: nnx.Module, pure_keys: list[tuple]) -> tuple:
    """Each :class:`Stacked` of ``model`` not inside another one: its path and the pure indices of
    its block's parameters in the order of the block's own ``nnx.split`` state."""
    paths = [tuple(path) for path, m in nnx.iter_modules(model) if isinstance(m, Stacked)]
    top = [p for p in paths if not any(q != p and p[:len(q)] == q for q in paths)]
    index = {key: i for i, key in enumerate(pure_keys)}
    out = []
    for path in top:
        _, block_state, _ = nnx.split(module_at(model, path).block, nnx.Param, ...)
        block_vars = jax.tree_util.tree_flatten_with_path(block_state, is_leaf=is_variable)[0]
        prefix = (*path, "block")
        out.append((path, tuple(index[prefix + path_key(p)] for p, _ in block_vars)))
    return tuple(out)




CONTEXT = attention_module.AXIS


def batch_axes_of(mesh: Mesh) -> tuple[str, ...]:
    sizes = dict(mesh.shape)
    return tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)  # size 1: nothing to split


def batch_spec_of(mesh: Mesh) -> P:
    """Rows over the batch axes; with a ``context`` axis the sequence (dimension 1) over it."""
    axes = batch_axes_of(mesh)
    rows = (axes[0] if len(axes) == 1 else axes) if axes else None
    if dict(mesh.shape).get(CONTEXT, 1) > 1:
        return P(rows, CONTEXT)
    return P(rows) if axes else P()


def group_by(leaves, axes_of_leaf, op):
    """``op(list, axes)`` once per group of leaves sharing the same non-empty axes."""
    leaves = list(leaves)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, axes in enumerate(axes_of_leaf):
        if axes:
            groups.setdefault(axes, []).append(i)
    for axes, indices in groups.items():
        for i, leaf in zip(indices, op([leaves[i] for i in indices], axes)):
            leaves[i] = leaf
    return leaves


def integer_ids_error(error: Exception, batch) -> ConfigError | None:
    """The one-line ConfigError for jax's refusal to index with floats (an embedding lookup of a
    float batch array: "indices must have an integer type", "Input type must be an integer"),
    naming the batch array; None for any other error."""
    text = str(error)
    if "integer" not in text or not ("indices" in text or "Input type" in text):
        return None
    for i, array in enumerate(batch):
        dtype = jax.numpy.result_type(array)
        if jax.numpy.issubdtype(dtype, jax.numpy.floating):
            return ConfigError(f"batch array {i} holds {dtype} values where the model looks up "
                               "integer ids (tokens of an embedding): pass integer token ids, "
                               "e.g. np.int32")
    return None


def check_batch_specs(batch_specs, mesh: Mesh):
    """``None`` (every batch array split on its first dimension over the batch axes), one
    ``PartitionSpec`` for every array, or a sequence of one per array; axes must be the mesh's."""
    if batch_specs is None:
        return None
    specs = (batch_specs,) if isinstance(batch_specs, P) else tuple(batch_specs)
    for spec in specs:
        if not isinstance(spec, P):
            raise ConfigError(f"batch_specs entry {spec!r} is not a jax.sharding.PartitionSpec")
        missing = zero_module.spec_axes(spec) - set(mesh.axis_names)
        if missing:
            raise ConfigError(f"batch_specs {spec} names axes {sorted(missing)} that the mesh "
                              f"{dict(mesh.shape)} lacks")
    return tuple(split_axes_only(spec, dict(mesh.shape)) for spec in specs)


def split_axes_only(spec: P, sizes: dict) -> P:
    """``spec`` without the axes of size 1 (they split nothing; nothing may vary over them)."""
    entries = []
    for entry in spec:
        group = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                      if a is not None and sizes[a] > 1)
        entries.append(None if not group else group[0] if len(group) == 1 else group)
    return P(*entries)


def mean_share(value, exclude: tuple[str, ...] = ()):
    """This rank's share of a global mean: ``value`` (the mean over what this rank holds) divided
    by the number of ranks it varies over (``check_vma``'s record: the batch axes, and any axis
    splitting the data, e.g. Seal et al.'s features over ``model``); ranks holding the same value
    count once. Returns the share and the axes to ``psum`` it over."""
    axes = tuple(a for a in sorted(metadata.varying_axes(value)) if a not in exclude)
    ranks = math.prod(lax.axis_size(a) for a in axes)
    return value / ranks, axes


def check_mesh(mesh) -> Mesh:
    """``mesh`` with every axis ``Auto`` (``jax.make_mesh`` makes ``Explicit`` ones by default):
    the step's own specs say where everything lives."""
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"mesh must be a jax.sharding.Mesh (jax.make_mesh or "
                          f"jphantom.runtime.mesh.make_mesh), not {type(mesh).__name__}")
    auto = (AxisType.Auto,) * len(mesh.axis_names)
    if tuple(mesh.axis_types) == auto:
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def warn_unstacked_blocks(model: nnx.Module, layout: ParamLayout) -> None:
    """ZeRO-3 gathers a :class:`Stacked`'s parameters layer by layer, every other parameter once
    for the whole step: a model whose repeated blocks are a list (``nnx.List``, a Python list)
    holds them all whole on every rank while the step runs. Said once, at construction."""
    stacks = [tuple(path) for path, m in nnx.iter_modules(model) if isinstance(m, Stacked)]
    lists = {}
    for path, module in nnx.iter_modules(model):
        if any(tuple(path[:len(s)]) == s for s in stacks):
            continue  # inside a Stacked: gathered layer by layer
        if len(path) > 1 and isinstance(path[-1], int) and any(
                isinstance(v, nnx.Param) for _, v in nnx.iter_graph(module)):
            lists.setdefault(".".join(map(str, path[:-1])), []).append(module)
    if not lists:
        return
    sizes = [math.prod(s.shape) for s in layout.shapes]
    stacked = layout.stacked
    whole = sum(n for i, n in enumerate(sizes) if layout.zero_dims[i] >= 0 and i not in stacked)
    where, blocks = max(lists.items(), key=lambda item: len(item[1]))
    warnings.warn(f"zero=3 gathers every parameter outside a jphantom.nn.Stacked once for the "
                  f"whole step: the {len(blocks)} blocks of {where} (with the rest, "
                  f"{whole / max(sum(sizes), 1):.0%} of the parameters) are whole on every rank "
                  "while it runs, not one block at a time; build them with "
                  "jphantom.nn.Stacked(make_block, layers, rngs=rngs) to gather them layer by "
                  "layer", JPhantomWarning, stacklevel=5)


def replace_dropout(model: nnx.Module) -> list[str]:
    """Every ``nnx.Dropout`` of ``model`` (the step's own copy) replaced by a
    :class:`jphantom.nn.dropout.Dropout`, its random state dropped; their paths."""
    from jphantom.plans import set_submodule, modules_by_path

    found = [(path, path_tuple, module) for path, (path_tuple, module)
             in modules_by_path(model).items() if isinstance(module, nnx.Dropout)]
    for path, path_tuple, module in found:
        set_submodule(model, path_tuple, dropout_module.Dropout.from_module(module, path))
    return [path for path, _, _ in found]


def private_copy(model: nnx.Module) -> nnx.Module:
    """A copy of ``model``'s modules and variables (their arrays shared, none changed): the step
    sets the blocks' remat policy and, with a stage axis, the layer axis' sharding metadata on its
    own copy, never on the model it was given."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
