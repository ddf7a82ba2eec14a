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
         "make_train_step": ("jphantom.train_step", "make_train_step"),
         "make_forward_fn": ("jphantom.train_step", "make_forward_fn"),
         "TrainState": ("jphantom.train_step", "TrainState"),
         "TrainStep": ("jphantom.train_step", "TrainStep"),
         "verify": ("jphantom.exactness", "verify"),
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
