"""jphantom: model-parallel training in JAX, measured on energy and communication.

Importing jphantom has no side effects on jax (no device simulation, no config changes).
"""

from jphantom.errors import ConfigError, JPhantomWarning, TrainingDiverged

__version__ = "0.1.0"
__all__ = ["ConfigError", "JPhantomWarning", "TrainingDiverged", "__version__"]
