"""One AMD Instinct GPU (an MI250X GCD or an MI300X): what jphantom's step compiles to and meters on
ROCm, the AMD counterpart of ``benchmarks/gpu_step.py``. Untested on AMD hardware until someone
runs it.

Checks, each recorded in ``DIR/amd_check.json`` with the device named (platform, ``device_kind``,
gfx architecture from the kernel driver's topology, jax and plugin versions):

``attention``  what ``attention="auto"`` picks on this device and why
               (:func:`jphantom.nn.attention.kernel_choice.choose`), and what it compiles to: a
               small Llama step (bf16), built as ``jphantom train --model llama`` builds it,
               compiled with ``--attention auto`` and with ``xla``;
               fused-attention custom calls in each compiled HLO
               (:func:`jphantom.analysis.hlo.kernels`), every custom-call target counted, the
               GEMMs by emitter, and the median step seconds of each.
``fp8``        the same step with ``precision="fp8"``: where jphantom builds it, how many GEMMs
               take FP8 operands and which FP8 types the HLO holds (gfx942, MI300X: FNUZ,
               ``f8e4m3fnuz`` / ``f8e5m2fnuz``), and three steps' losses; where it refuses (gfx90a,
               MI250X: no FP8 units), its message.
``energy``     :class:`jphantom.costs.metrics.StepEnergy` on this GPU (its source: ``amdsmi`` where the
               counter works), joules of a few bf16 matmul steps; and
               :class:`jphantom.energy.AmdsmiEnergyMeter` directly: ``available()``, the
               counter read during the window (it must never stick or step backwards:
               ``unreliable``), joules, seconds and mean watts. On an MI250X only one GCD of a
               package reports energy: a process on the silent GCD records the refusal.

A check's finding (FP8 refused, no energy counter) is data, not a failure. Exit status: 0 when
every check ran, 1 when one raised (its error is in the JSON), 2 with one line when this machine
has no AMD GPU (nothing else is done: jax is not even imported).

Usage (one GPU; about a minute)::

    PYTHONPATH=. python benchmarks/amd_check.py --out DIR

``--any-device`` runs the checks on whatever jax has (tiny shapes, CPU included), labelled as not
an AMD GPU: for working on the script without one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")
SHAPE = dict(layers=2, hidden=512, heads=8, kv_heads=4, intermediate=1024, vocab=2048,
             seq_len=1024, batch=4)
TINY = dict(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=128, vocab=256, seq_len=32,
            batch=2)
FP8_TYPES = ("f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3fn", "f8e5m2")


def gfx_name(version: int) -> str:
    """The gfx architecture of a KFD ``gfx_target_version`` (90010 -> gfx90a, 90402 -> gfx942)."""
    major, minor, stepping = version // 10000, version // 100 % 100, version % 100
    return f"gfx{major}{minor}{stepping:x}"


def amd_gpus(nodes: Path = KFD_NODES) -> list[str]:
    """The gfx names of the GPUs the kernel driver lists (CPU nodes, version 0, left out)."""
    found = []
    for properties in sorted(nodes.glob("*/properties")) if nodes.is_dir() else ():
        for line in properties.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "gfx_target_version" and value.strip().isdigit() and int(value):
                found.append(gfx_name(int(value)))
    return found


# --------------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------------


def _llama_step(shape: dict, precision: str, attention: str):
    """A Llama step on one device, built as ``jphantom train`` builds it
    (:class:`jphantom.config.RunConfig`: the FP8 formats of the device chosen, or FP8 refused,
    before anything is traced): (compiled, run(state) -> (state, loss), state)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jphantom.config import RunConfig

    config = RunConfig.from_flags(
        model="llama", layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"],
        kv_heads=shape["kv_heads"], intermediate=shape["intermediate"], vocab=shape["vocab"],
        seq_len=shape["seq_len"], batch=shape["batch"], mesh="model=1", precision=precision,
        attention=attention, optimizer="adamw")
    built = config.build()  # refuses --precision fp8 where the device has no FP8 GEMMs
    rng = np.random.default_rng(0)
    rows = (shape["batch"], shape["seq_len"])
    batch = tuple(jnp.asarray(rng.integers(0, shape["vocab"], rows), jnp.int32) for _ in "xy")
    batch = jax.device_put(batch, built.shardings)
    state = built.program.init(built.step)  # parameters created in their shards
    compiled = built.step.lower(state, *batch).compile()
    return compiled, lambda state: compiled(state, *batch), state


def _timed(run, state, steps: int) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for i in range(steps + 1):
        started = time.perf_counter()
        state, loss = run(state)
        losses.append(float(loss))  # waits for the step
        if i:  # the first call is the warm-up
            times.append(time.perf_counter() - started)
    return losses, times


def _census(text: str) -> dict:
    """Fused attention, Pallas kernels, GEMMs by emitter (:func:`jphantom.analysis.hlo.kernels`)
    and every custom-call target with how often it appears in the text."""
    import re

    from jphantom.analysis.hlo import kernels

    found = kernels(text)
    targets: dict[str, int] = {}
    for name in re.findall(r'custom_call_target="([^"]*)"', text):
        targets[name] = targets.get(name, 0) + 1
    return {"attention": found["attention"], "pallas": found["pallas"], "gemms": found["gemms"],
            "custom_call_targets": targets}


def check_attention(shape: dict, steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jphantom.nn.attention.kernel_choice import choose, platform_of

    device = jax.devices()[0]
    head_dim = shape["hidden"] // shape["heads"]
    kernel, why = choose("auto", platform_of(device), jnp.bfloat16, head_dim)
    out = {"platform": platform_of(device), "head_dim": head_dim, "auto_picks": kernel,
           "why": why, "runs": {}}
    for attention in ("auto", "xla"):
        started = time.perf_counter()
        compiled, run, state = _llama_step(shape, "bf16", attention)
        row = {"compile_seconds": time.perf_counter() - started,
               **_census(compiled.as_text())}
        losses, times = _timed(run, state, steps)
        row |= {"losses": losses, "median_step_seconds": sorted(times)[len(times) // 2]}
        out["runs"][attention] = row
    return out


def check_fp8(shape: dict, steps: int) -> dict:
    from jphantom.errors import ConfigError

    try:
        compiled, run, state = _llama_step(shape, "fp8", "auto")
    except ConfigError as error:  # jphantom refuses FP8 here, by name
        if "fp8" not in str(error).lower():
            raise
        return {"built": False, "refused": str(error)}
    text = compiled.as_text()
    census = _census(text)
    losses, times = _timed(run, state, steps)
    return {"built": True, "fp8_gemms": census["gemms"]["fp8"],
            "fp8_upcast_gemms": census["gemms"]["fp8_upcast"], "gemms": census["gemms"],
            "fp8_types_in_hlo": {t: text.count(f"{t}[") for t in FP8_TYPES},
            "fnuz": any(f"{t}[" in text for t in FP8_TYPES[:2]),
            "losses": losses, "finite": all(abs(x) < float("inf") for x in losses),
            "median_step_seconds": sorted(times)[len(times) // 2]}


def check_energy(small: bool, seconds: float) -> dict:
    import warnings

    import jax
    import jax.numpy as jnp

    from jphantom.energy import AmdsmiEnergyMeter
    from jphantom.errors import ConfigError
    from jphantom.costs.metrics import StepEnergy

    n = 256 if small else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a: (a @ a) * 1e-4)
    jax.block_until_ready(matmul(a))
    per_step = max(1, int(0.2 / max(1e-6, _seconds_of(matmul, a))))

    def work(repeats: int):
        x = a
        for _ in range(repeats):
            x = matmul(x)
        return jax.block_until_ready(x)

    devices = jax.devices()[:1]
    out = {"matmul_n": n, "matmuls_per_step": per_step}
    energy = StepEnergy.for_devices(devices)
    out["step_energy_source"] = energy.source
    joules = []
    for _ in range(5):
        energy.begin()
        started = time.perf_counter()
        work(per_step)
        joules.append(energy.end(time.perf_counter() - started))
    energy.close()
    out["step_joules"] = joules
    out["step_energy_source_after"] = energy.source
    ok, why = AmdsmiEnergyMeter.available()
    out["amdsmi_available"], out["amdsmi_says"] = ok, why
    if not ok:
        return out
    meter = AmdsmiEnergyMeter(devices, gather=lambda row: row[None])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            meter.start()
        except ConfigError as error:  # the silent GCD of an MI250X package
            out["meter_refused"] = str(error)
            return out
        readings, started = [], time.perf_counter()
        while time.perf_counter() - started < seconds:
            work(per_step)
            readings.append(meter.read())
        try:
            measured = meter.stop()
            out |= {"joules": measured.joules, "seconds": measured.seconds,
                    "mean_watts": measured.joules / measured.seconds, "method": measured.method}
        except RuntimeError as error:
            out["stop_raised"] = str(error)
    out |= {"readings_j": readings, "unreliable": meter.unreliable,
            "monotonic": all(b is not None and a is not None and b >= a
                             for a, b in zip(readings, readings[1:])),
            "warnings": [str(w.message) for w in caught]}
    return out


def _seconds_of(f, a) -> float:
    import jax

    started = time.perf_counter()
    jax.block_until_ready(f(a))
    return time.perf_counter() - started


def device_info(gfx: list[str]) -> dict:
    import importlib.metadata

    import jax

    device = jax.devices()[0]
    versions = {}
    for package in ("jax", "jaxlib", "jax-rocm7-plugin", "jax-rocm7-pjrt", "amdsmi"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"platform": device.platform, "device_kind": getattr(device, "device_kind", ""),
            "devices": len(jax.devices()), "gfx_from_kfd": gfx,
            "compute_capability": str(getattr(device, "compute_capability", "")) or None,
            "versions": versions}


# --------------------------------------------------------------------------------------------------


def main(argv=None, *, kfd_nodes: Path = KFD_NODES) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for amd_check.json")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--energy-seconds", type=float, default=3.0,
                        help="seconds of matmuls metered by the amdsmi counter")
    parser.add_argument("--any-device", action="store_true",
                        help="run on whatever jax has, tiny shapes (no AMD GPU needed)")
    args = parser.parse_args(argv)
    gfx = amd_gpus(kfd_nodes)
    if not gfx and not args.any_device:
        print(f"amd_check: no AMD GPU on this machine ({kfd_nodes} lists none): run it where "
              "rocm-smi shows an MI250X or MI300X", flush=True)
        return 2
    import jax

    if not args.any_device and jax.devices()[0].platform not in ("rocm", "gpu"):
        print(f"amd_check: jax sees no ROCm device ({jax.devices()[0].platform} only) although "
              f"the driver lists {', '.join(gfx)}: pip install 'jphantom[rocm]' (the jax-rocm7 "
              "plugin at jax's version)", flush=True)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY if args.any_device else SHAPE
    results = {"device": device_info(gfx), "shape": shape,
               "amd_gpu": bool(gfx), "label": "measured" if gfx else
               "--any-device: not an AMD GPU (plumbing only)", "errors": {}}
    checks = (("attention", lambda: check_attention(shape, args.steps)),
              ("fp8", lambda: check_fp8(shape, args.steps)),
              ("energy", lambda: check_energy(args.any_device, args.energy_seconds)))
    for name, check in checks:
        started = time.perf_counter()
        try:
            results[name] = check()
        except Exception as error:  # noqa: BLE001 (recorded; the other checks still run)
            results["errors"][name] = "".join(traceback.format_exception(error))[-3000:]
        print(f"{name}: {time.perf_counter() - started:.1f} s: "
              f"{json.dumps(results.get(name), default=str)[:600]}", flush=True)
        (out / "amd_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"{results['device']['device_kind']} ({', '.join(gfx) or 'no AMD GPU'}): wrote "
          f"{out / 'amd_check.json'}; errors: {sorted(results['errors']) or 'none'}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
