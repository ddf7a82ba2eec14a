"""jphantom: model-parallel training in JAX, measured on energy and communication.

Bring your own Flax NNX model::

    import jphantom
    model = jphantom.parallelize(model, mesh, jphantom.plans.megatron(model))
    step = jphantom.make_train_step(model, mesh, optax.adamw(3e-4), loss_fn)
    state = step.init()
    state, loss = step(state, tokens, targets)
    print(jphantom.verify(model, mesh, plan, loss_fn, tokens, targets))  # exact vs one device?
    out = jphantom.generate(model, [[1, 2, 3]], jphantom.GenerationConfig(max_new_tokens=8))

Importing jphantom has no side effects on jax (no device simulation, no config changes); the
modules behind these names load on first use.
"""

import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys

from jphantom.errors import ConfigError, JPhantomWarning, TrainingDiverged

__version__ = "0.1.0"
__all__ = ["ConfigError", "JPhantomWarning", "TrainingDiverged", "__version__", "parallelize",
           "dense_equivalent", "Style", "plans", "make_train_step", "make_forward_fn",
           "register_style", "TrainState", "TrainStep", "nn", "verify", "generate",
           "GenerationConfig"]

_LAZY = {"parallelize": ("jphantom.plans", "parallelize"),
         "dense_equivalent": ("jphantom.plans", "dense_equivalent"),
         "Style": ("jphantom.plans", "Style"),
         "register_style": ("jphantom.plans", "register_style"),
         "make_train_step": ("jphantom.step.train_step", "make_train_step"),
         "make_forward_fn": ("jphantom.step.train_step", "make_forward_fn"),
         "TrainState": ("jphantom.step.train_step", "TrainState"),
         "TrainStep": ("jphantom.step.train_step", "TrainStep"),
         "verify": ("jphantom.step.exactness", "verify"),
         "generate": ("jphantom.generation", "generate"),
         "GenerationConfig": ("jphantom.generation", "GenerationConfig")}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    if name in ("plans", "nn"):
        return importlib.import_module(f"jphantom.{name}")
    raise AttributeError(f"module 'jphantom' has no attribute {name!r}")


# Modules that moved into packages by role keep their old paths for one release: ``import
# jphantom.mesh`` (or ``from jphantom import mesh``) is :mod:`jphantom.runtime.mesh`, the same
# module object, with a DeprecationWarning the first time. No file is left at the old path.
_MOVED = {
          "aot": "costs.aot",
          "attention_choices": "registry.attention_choices",
          "callbacks": "loop.callbacks",
          "checkpoint": "loop.checkpointer",
          "collectives": "runtime.collectives",
          "comm": "runtime.comm",
          "compare": "loop.compare",
          "coordinator": "runtime.coordinator",
          "distributed": "runtime.distributed",
          "dtypes": "registry.dtypes",
          "exactness": "step.exactness",
          "families": "registry.families",
          "fp8": "step.fp8",
          "gpu_defaults": "runtime.gpu_defaults",
          "inventory": "costs.inventory",
          "launch": "runtime.launch",
          "layer_plans": "registry.layer_plans",
          "lazy": "registry.lazy",
          "mesh": "runtime.mesh",
          "metrics": "costs.metrics",
          "precision": "step.precision",
          "program": "registry.program",
          "remat": "step.remat",
          "resilience": "runtime.resilience",
          "run": "loop.trainer",
          "sources": "loop.sources",
          "strategies": "registry.strategies",
          "token_mean": "step.token_mean",
          "train_step": "step.train_step",
          "zero": "step.zero"}


class _MovedModules(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """Finds ``jphantom.<old>`` and loads it as its new module (first on the path, so that a
    stale file left at the old place by an install over an older one is not imported)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("jphantom.") and fullname[len("jphantom."):] in _MOVED:
            return _importlib_util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        import importlib
        import sys
        import warnings

        new = "jphantom." + _MOVED[module.__name__[len("jphantom."):]]
        warnings.warn(f"{module.__name__} is now {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)


if not any(isinstance(finder, _MovedModules) for finder in _sys.meta_path):
    _sys.meta_path.insert(0, _MovedModules())
