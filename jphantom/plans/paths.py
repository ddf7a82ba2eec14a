"""A model's modules by dotted path, as plans name them, and the modules a plan leaves
unplaced: the path of every submodule, swapping one in place, whether a module holds parameters of
its own, and the error naming a module that holds parameters no plan entry covers."""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

from jphantom.errors import ConfigError


def _path(path) -> str:
    return ".".join(str(part) for part in path)


def modules_by_path(model: nnx.Module) -> dict[str, tuple]:
    """Every submodule of ``model``: dotted path -> (path tuple, module)."""
    return {_path(path): (tuple(path), module) for path, module in nnx.iter_modules(model)
            if path}


def set_submodule(model, path: tuple, new) -> None:
    parent = model
    for part in path[:-1]:
        parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    last = path[-1]
    if isinstance(last, int):
        parent[last] = new
    else:
        setattr(parent, last, new)


def holds_params(module) -> bool:
    """Whether ``module`` holds an ``nnx.Param`` as an attribute of its own (not through a
    submodule)."""
    return any(isinstance(value, nnx.Param) for value in vars(module).values())


def unplaced(path: str, module, sequence_parallel: bool, walk: str) -> ConfigError:
    """The error for a module holding parameters that a ready-made plan cannot place."""
    kind = type(module).__name__
    names = ", ".join(n for n, v in vars(module).items() if isinstance(v, nnx.Param))
    fix = (f"named={{{path!r}: jphantom.Style('sequence')}} if it treats each token alone (a "
           "norm before column layers: it runs on the rank's S/p tokens, then the sequence is "
           "gathered), or register a style for its class (jphantom.register_style)"
           if sequence_parallel else
           f"named={{{path!r}: 'replicate'}} to keep it whole on every rank (right for a "
           "module that needs no split, such as a norm), or register a style for its class "
           "(jphantom.register_style)")
    return ConfigError(f"{walk} cannot place {path} ({kind}, holding {names}): name it, "
                       f"{fix} (in a plan of your own: the same entry)")


def inside(path: str, plan: Mapping) -> bool:
    """Whether ``path`` lies inside a module the plan already names (a mixture of experts is
    one entry)."""
    return any(path.startswith(named + ".") for named in plan)
