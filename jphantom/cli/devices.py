"""Which devices a command runs on: the machine's accelerators when jax can use them, else
simulated CPU devices, chosen before jax starts (``--devices N`` forces N CPU devices).

Without ``--devices`` the choice is made from what is visible without starting jax
(:func:`accelerator_visible`): ``JAX_PLATFORMS`` if set, else an NVIDIA (``nvidia-smi``) or AMD
(``rocm-smi``) tool on the PATH together with an installed jax plugin for it. No accelerator:
:data:`DEFAULT_SIMULATED_DEVICES` (8) CPU devices are simulated.
"""

from __future__ import annotations

import argparse

DEFAULT_SIMULATED_DEVICES = 8


def accelerator_visible(env=None) -> bool:
    """:func:`jphantom.runtime.distributed.accelerator_visible` (kept here for the CLI's callers)."""
    from jphantom.runtime.distributed import accelerator_visible as visible

    return visible(env)


def device_count(text: str) -> int:
    """``--devices N``: an integer from 1 to :data:`jphantom.runtime.mesh.MAX_SIMULATED_DEVICES`."""
    from jphantom.runtime.mesh import MAX_SIMULATED_DEVICES

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_SIMULATED_DEVICES:
        raise argparse.ArgumentTypeError(
            f"{value} simulated devices: give 1 to {MAX_SIMULATED_DEVICES}")
    return value


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices", type=device_count, default=None, metavar="N",
        help="simulate N CPU devices (forces the CPU backend). Default: the machine's GPUs if jax "
             f"can use them, else {DEFAULT_SIMULATED_DEVICES} simulated CPU devices.",
    )


def setup_devices(count: int | None, *, at_least: bool = False) -> None:
    """Must run before anything touches a jax backend (module docstring). ``at_least``: ``count``
    is a minimum (a running jax with more devices is fine), not a request."""
    if count is None and accelerator_visible():
        return
    import jax

    from jphantom.errors import ConfigError
    from jphantom.runtime.mesh import simulate_cpu_devices

    explicit = count is not None and not at_least
    count = count if count is not None else DEFAULT_SIMULATED_DEVICES
    try:
        jax.config.update("jax_platforms", "cpu")
        simulate_cpu_devices(count)
    except RuntimeError as error:
        # jax is already running (e.g. called from Python after jax started): keep its devices,
        # unless a count was asked for explicitly and differs.
        if explicit:
            raise ConfigError(str(error).split(". ")[0] + f": cannot simulate {count} devices "
                              "in this process; start a fresh one") from None
        return
    from jphantom.cli.quiet import start_backends_quietly

    start_backends_quietly()  # without a GPU but with the CUDA plugin: its start-up lines dropped
