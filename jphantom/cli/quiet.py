"""The command line without a GPU but with jax's CUDA plugin installed (``jphantom[aot]``, what
``compile --target gpu:...`` needs): jax's start would print the plugin's C++ start-up lines
("Could not find cuda drivers on your machine", four times) and, at the first use of jax, a
20-line "Unable to load CUDA. Is it installed?" traceback, before every command.

The rule (:func:`quiet_missing_gpu`): when ``JAX_PLATFORMS`` is unset, a CUDA plugin is installed
and this machine has no accelerator device node (``/dev/nvidia*``, ROCm's ``/dev/kfd``, a TPU's
``/dev/accel*`` or ``/dev/vfio/<n>``), the command sets ``JAX_PLATFORMS=cpu`` (the plugin is not
started; its compiler still serves ``compile``'s GPU targets, which start jax on the CPU anyway)
and drops those start-up lines, and only those, from what jax's import and its backends' start
write to stderr (:func:`filtered_stderr`). Importing jphantom in Python changes nothing: there,
set ``JAX_PLATFORMS=cpu`` yourself.

The ROCm plugin (``jphantom[rocm]``, what ``compile --target rocm:...`` needs) is quieter in C++
but declines loudly: without ``/dev/kfd`` jax logs "Jax plugin configuration error: Exception when
calling jax_plugins.xla_rocm7.initialize()" and a traceback at every start, ``JAX_PLATFORMS=cpu``
or not. Under the same rule that one log record, and only it, is dropped
(:func:`jphantom.rocm.shim.quiet_declined_plugin`: the logger is jax's private module's).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import tempfile
from collections.abc import Iterator

# The lines the CUDA plugin's libraries log when they find no driver (absl, before its logging
# is initialised): every other line written meanwhile is kept.
NOISE = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
         "cudart_stub.cc", "Could not find cuda drivers on your machine")
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
_ROCM_PLUGINS = ("jax_rocm7_plugin", "jax_rocm10_plugin")
_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel*",
                 "/dev/vfio/[0-9]*")
_quieted = False


def missing_gpu(env=None) -> bool:
    """Whether the rule applies (module docstring): ``JAX_PLATFORMS`` unset, a CUDA or ROCm
    plugin installed, no accelerator device node."""
    from jphantom.runtime.distributed import has_module

    env = os.environ if env is None else env
    return ("JAX_PLATFORMS" not in env
            and any(has_module(name) for name in _CUDA_PLUGINS + _ROCM_PLUGINS)
            and not any(glob.glob(pattern) for pattern in _DEVICE_NODES))


@contextlib.contextmanager
def filtered_stderr(noise: tuple[str, ...] = NOISE) -> Iterator[None]:
    """File descriptor 2 (where C++ logs) into a temporary file while the block runs; then every
    line that contains none of ``noise`` is written to stderr, in order."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(True)
                    if not any(text in line for text in noise)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def quiet_missing_gpu() -> None:
    """At the command line's start: under the rule, ``JAX_PLATFORMS=cpu`` and jax imported with
    the plugin's start-up lines dropped (:func:`start_backends_quietly` drops its later ones)."""
    global _quieted
    if "jax" in sys.modules or not missing_gpu():  # jax started: too late to choose
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    _quieted = True
    from jphantom.rocm.shim import quiet_declined_plugin

    quiet_declined_plugin()
    with filtered_stderr():
        import jax  # noqa: F401


def start_backends_quietly() -> None:
    """Start jax's backends now, the plugin's lines dropped, when :func:`quiet_missing_gpu`
    applied; call it once the devices are configured (a no-op otherwise)."""
    if _quieted:
        import jax

        with filtered_stderr():
            jax.devices()
