"""What ``jphantom generate`` measures: time to first token (the prefill and the first token,
run as their own program of ``max_new_tokens=1`` on the same bucket), decode tokens/s (the
tokens after each row's first over the rest of the time), and joules per generated token from
the devices' energy counters (:class:`jphantom.costs.metrics.StepEnergy`: NVML on NVIDIA GPUs, amdsmi
on AMD) or, elsewhere, Seal et al.'s Eq. 1 at the busy power for the wall time, labelled
``modelled``; beside them the bytes a decode step reads at least (every weight and the whole
key/value cache, summed over the devices: the HBM roofline's numerator, :func:`jphantom.generation.cache.decode_bytes`)."""

from __future__ import annotations

import dataclasses

import jax

from jphantom.generation.api import Generation, generate
from jphantom.generation.config import GenerationConfig


def measured(model, prompts, config: GenerationConfig, mesh=None) -> tuple[Generation, dict]:
    """``(generation, figures)``: the completions and what they cost (module docstring)."""
    from jphantom.costs.metrics import StepEnergy

    one = dataclasses.replace(config, max_new_tokens=1, return_logits=False)
    generate(model, prompts, one, mesh=mesh)  # compiled and run once: the next call is warm
    first = generate(model, prompts, one, mesh=mesh)
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    energy = StepEnergy.for_devices(devices)
    generate(model, prompts, config, mesh=mesh)  # compiled: the measured call below runs only
    energy.begin()
    out = generate(model, prompts, config, mesh=mesh)
    joules = energy.end(out.seconds)
    source = energy.source
    energy.close()
    generated = sum(len(c) for c in out.completions)
    after_first = generated - len(out.completions)
    decode_seconds = max(out.seconds - first.seconds, 1e-9)
    figures = {
        "prompts": len(out.completions), "bucket": out.bucket, "cached": out.cached,
        "generated_tokens": generated, "steps": out.steps,
        "time_to_first_token_s": first.seconds, "seconds": out.seconds,
        "decode_tokens_per_s": after_first / decode_seconds if after_first else None,
        "tokens_per_s": generated / out.seconds,
        "joules": joules, "joules_per_token": joules / generated if joules is not None else None,
        "energy_source": source, "devices": len(devices),
    }
    if out.cached:  # what a decode step reads at least (the HBM roofline's bytes), all devices
        from jphantom.generation.cache import decode_bytes
        from jphantom.plans import dense_equivalent
        whole = model if mesh is None else dense_equivalent(model)
        figures.update(decode_bytes(whole, len(out.completions),
                                    out.bucket + config.max_new_tokens))
    return out, figures


def summary(figures: dict) -> str:
    """One line of the figures, the energy's source named (``modelled`` where nothing metered)."""
    per_token = figures["joules_per_token"]
    energy = (f"{per_token:.3g} J/token ({figures['energy_source']})" if per_token is not None
              else f"energy unknown ({figures['energy_source']})")
    decode = figures["decode_tokens_per_s"]
    return (f"generate: {figures['prompts']} prompt(s), bucket {figures['bucket']}, "
            f"{figures['generated_tokens']} tokens in {figures['steps']} step(s); time to first "
            f"token {figures['time_to_first_token_s'] * 1e3:.1f} ms, decode "
            + (f"{decode:.1f} tokens/s" if decode is not None else "n/a")
            + f", {energy}" + (f"; a decode step reads {_mib(figures)} (weights and cache)"
                               if "cache_bytes" in figures else "; no key/value cache"))


def _mib(figures: dict) -> str:
    return f"{(figures['weights_bytes'] + figures['cache_bytes']) / 2**20:.3g} MiB"
