"""One GPU: measure the numbers of a device description (:mod:`jphantom.predict.device`) and write
a description file the simulator reads (``jphantom.predict.load(path)``).

Measured here, with jax, each number labelled ``source = "measured"`` and cited
``"<device_kind>, jax <version>, <UTC date>, benchmarks/calibrate.py; <how>"``:

``gemm``        TFLOP/s of ``jax.lax.dot_general`` over a grid of (M, N, K) shapes (1024..16384,
                8192^3 among them) in bf16, FP8 (E4M3 x E4M3 -> bf16, compiled as an FP8 run's
                GEMMs are: ``gpu_defaults.fp8_gemm_options``, cuBLAS-LT's FP8 call on NVIDIA)
                and float32 (default precision: TF32 tensor cores on Hopper).
                ``gemm_efficiency.<dtype>`` = the 8192^3 rate / the datasheet peak.
                ``gemm_shape.k_half``: one parameter fitted by
                least squares on log rates over the bf16 and FP8 grids, the efficiency held at
                the 8192^3 value and wave quantisation taken from ``sm_count`` and ``tile``
                (device.py's model); shapes faster than 30 us a call are left out of the fit
                (their time is the host's dispatch). ``gemm_shape.sm_count``: jax's
                ``device.core_count``.
``attention``   cuDNN fused attention (``jax.nn.dot_product_attention(..., is_causal=True,
                implementation="cudnn")``) forward, and forward + backward (its vjp) less the
                forward, bf16, B x H = 32, S in {1024, 4096, 8192}, head dim 64 and 128;
                FLOPs 4 B H S^2 D / 2 forward, 2.5 x that backward; the efficiencies (of the bf16
                peak) are the largest S's.
``stream``      ``x * 2 + y`` over 1 GiB float32 arrays: 3 GiB through HBM per call;
                ``memory.stream_efficiency`` = bytes/s / the datasheet ``hbm_gbps``.
``launch``      one jitted program of 1000 tiny dependent ops (``x * (1 + 1e-6 sum(x))`` on
                1024 floats, unrolled); ``launch.kernel_us`` = (measured seconds - the
                simulator's seconds for the same HLO with no launch cost) / the kernels it counts.
                The same ops as a ``fori_loop`` (10 a trip) give a while trip's cost beyond its
                kernels (recorded in the JSON only: the simulator has no such term).
``power``       NVML ``nvmlDeviceGetPowerUsage`` every 50 ms, 3 s idle and 5 s of back-to-back
                8192^3 bf16 GEMMs (the first second dropped): medians -> ``power.idle_watts``,
                ``power.busy_watts``.

Everything else (peaks, HBM size and bandwidth, tile, network) is kept from the base
description (``--base NAME|PATH``; default the shipped one whose ``device_kinds`` match jax's
``device_kind``, :func:`jphantom.predict.device.for_kind`), with its source and cite.

Usage (the device machine has jax and nvidia-ml-py; nothing to install)::

    PYTHONPATH=. python benchmarks/calibrate.py --out DIR          # on one GPU, about 2 minutes
    PYTHONPATH=. python benchmarks/calibrate.py --small --out /tmp/c   # tiny shapes, CPU too

Writes ``DIR/<name>.toml`` (the description, ``<name>`` = the base's name + ``-measured``, or
``cpu-small-measured`` on a CPU, whose numbers only test the plumbing) and ``DIR/calibrate.json``
(every raw sample, the fit, and ``description_path``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import re
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FALLBACK_DESCRIPTIONS = ("h100-sxm",)  # when no shipped kind matches

FULL = dict(
    gemm=[(8192, 8192, 8192), (4096, 4096, 4096), (2048, 2048, 2048), (16384, 8192, 8192),
          (8192, 8192, 1024), (8192, 8192, 2048), (8192, 8192, 4096), (4096, 14336, 4096),
          (1024, 8192, 8192), (16384, 4096, 1024)],
    gemm_f32=[(8192, 8192, 8192), (4096, 4096, 4096)],
    reference=8192, attention_bh=(2, 16), attention_s=(1024, 4096, 8192),
    stream_elements=2**28, launch_ops=1000, launch_elements=1024,
    idle_s=3.0, busy_s=5.0, min_batch_s=0.02, reps=3)
SMALL = dict(
    gemm=[(256, 256, 256), (128, 128, 128), (256, 256, 64), (256, 256, 512), (128, 512, 256)],
    gemm_f32=[(256, 256, 256), (128, 128, 128)],
    reference=256, attention_bh=(1, 2), attention_s=(64, 128),
    stream_elements=2**20, launch_ops=30, launch_elements=256,
    idle_s=0.3, busy_s=0.5, min_batch_s=0.003, reps=2)
HOST_BOUND_S = 30e-6  # a GEMM call faster than this is timed as the host's dispatch: not fitted


def log(message: str) -> None:
    print(f"[calibrate {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def time_call(f, *args, reps: int, min_batch_s: float, max_batch: int = 200) -> dict:
    """Median seconds of one call of the jitted ``f``: after a compile-and-warm call, ``reps``
    batches of ``n`` calls dispatched back to back (``n`` sized so a batch lasts ``min_batch_s``),
    each batch's time / n."""
    import jax

    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, min(max_batch, int(min_batch_s / one)))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / n)
    return {"seconds": statistics.median(samples), "samples": samples, "calls_per_batch": n}


def _custom_calls(hlo: str) -> list[str]:
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))


# ------------------------------------------------------------------------------------------------
# The measurements
# ------------------------------------------------------------------------------------------------


def measure_gemms(plan: dict, deadline: float = math.inf) -> dict:
    """TFLOP/s of each GEMM of the plan's grid per dtype; shapes left once ``deadline``
    (``time.perf_counter()``) has passed are recorded as skipped."""
    import jax
    import jax.numpy as jnp

    from jphantom.runtime import gpu_defaults

    dtypes = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "f32": jnp.float32}
    # FP8 as an FP8 run compiles it (on NVIDIA GPUs cuBLAS-LT's FP8 call, not the Triton fusion
    # this process's flags would give): the kernel the description's FP8 rate prices
    options = {"fp8": gpu_defaults.fp8_gemm_options(jax.devices()[0])}
    out = {"fp8_compiler_options": options["fp8"]}
    for name, dtype in dtypes.items():
        shapes = plan["gemm_f32"] if name == "f32" else plan["gemm"]
        rows = []
        for m, n, k in shapes:
            # B stored [N, K] (the "TN" layout cuBLASLt's FP8 GEMM takes): no transpose kernel
            a = jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32).astype(dtype)
            b = jax.random.normal(jax.random.PRNGKey(1), (n, k), jnp.float32).astype(dtype)
            result = jnp.float32 if name == "f32" else jnp.bfloat16
            f = jax.jit(lambda a, b, r=result: jax.lax.dot_general(
                a, b, (((1,), (1,)), ((), ())), preferred_element_type=r))
            row = {"m": m, "n": n, "k": k}
            if time.perf_counter() > deadline:
                rows.append({**row, "error": "skipped: the GEMM stage's time was up"})
                continue
            try:
                compiled = f.lower(a, b).compile(compiler_options=options.get(name) or None)
                hlo = compiled.as_text()
                timing = time_call(compiled, a, b, reps=plan["reps"],
                                   min_batch_s=plan["min_batch_s"])
                row.update(timing, tflops=2 * m * n * k / timing["seconds"] / 1e12,
                           host_bound=timing["seconds"] < HOST_BOUND_S,
                           custom_calls=_custom_calls(hlo))
                log(f"gemm {name} {m}x{n}x{k}: {row['tflops']:.1f} TFLOP/s "
                    f"({timing['seconds'] * 1e6:.0f} us)")
            except Exception as error:  # noqa: BLE001 (no such GEMM on this platform)
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                log(f"gemm {name} {m}x{n}x{k}: failed: {row['error']}")
            rows.append(row)
            del a, b
        out[name] = rows
    return out


def fit_k_half(rows: list[dict], reference_rate: float, sm_count: float, tile: float,
               reference: int) -> dict:
    """``k_half`` minimising the squared log error of device.py's shape model
    (``rate = R_ref x quantisation(M N) x (K / (K + k_half)) / (8192 / (8192 + k_half))``,
    ``R_ref`` the measured reference rate over its own quantisation) over ``rows``
    (``(m, n, k, tflops)``): a grid search over 0..8192, log-spaced."""

    def quantisation(outputs):
        tiles = max(1.0, math.ceil(outputs / (tile * tile)))
        return tiles / (math.ceil(tiles / sm_count) * sm_count)

    base = reference_rate / quantisation(reference * reference)
    candidates = [0.0] + [2 ** (i / 8) for i in range(0, 8 * 13 + 1)]  # 1 .. 8192

    def loss(kh):
        total = 0.0
        for m, n, k, rate in rows:
            model = base * quantisation(m * n) * (k / (k + kh)) / (8192 / (8192 + kh))
            total += math.log(rate / model) ** 2
        return total

    best = min(candidates, key=loss)
    return {"k_half": best, "loss": loss(best), "points": len(rows),
            "loss_at_zero": loss(0.0)}


def measure_attention(plan: dict, on_gpu: bool) -> dict:
    import jax
    import jax.numpy as jnp

    b, h = plan["attention_bh"]
    implementation = "cudnn" if on_gpu else None
    out = {"batch": b, "heads": h, "implementation": implementation or "xla (no cuDNN here)",
           "rows": []}
    for d in (64, 128):
        for s in plan["attention_s"]:
            keys = jax.random.split(jax.random.PRNGKey(s + d), 4)
            q, k, v, do = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in keys)

            def attn(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                    implementation=implementation)

            fwd = jax.jit(attn)
            both = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
            flops = 4 * b * h * s * s * d / 2
            row = {"seq": s, "head_dim": d, "forward_flops": flops,
                   "backward_flops": 2.5 * flops}
            try:
                tf = time_call(fwd, q, k, v, reps=plan["reps"], min_batch_s=plan["min_batch_s"])
                tb = time_call(both, q, k, v, do, reps=plan["reps"],
                               min_batch_s=plan["min_batch_s"])
                backward = max(tb["seconds"] - tf["seconds"], 1e-9)
                row.update(forward_seconds=tf["seconds"], forward_samples=tf["samples"],
                           forward_and_backward_seconds=tb["seconds"],
                           forward_and_backward_samples=tb["samples"], backward_seconds=backward,
                           forward_tflops=flops / tf["seconds"] / 1e12,
                           backward_tflops=2.5 * flops / backward / 1e12,
                           custom_calls=_custom_calls(both.lower(q, k, v, do).compile().as_text()))
                log(f"attention hd{d} S={s}: forward {row['forward_tflops']:.1f}, backward "
                    f"{row['backward_tflops']:.1f} TFLOP/s")
            except Exception as error:  # noqa: BLE001 (no cuDNN attention for this shape)
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                log(f"attention hd{d} S={s}: failed: {row['error']}")
            out["rows"].append(row)
    return out


def measure_stream(plan: dict) -> dict:
    import jax
    import jax.numpy as jnp

    n = plan["stream_elements"]
    x = jnp.ones((n,), jnp.float32)
    y = jnp.full((n,), 0.5, jnp.float32)
    f = jax.jit(lambda x, y: x * 2 + y)
    timing = time_call(f, x, y, reps=max(3, plan["reps"]), min_batch_s=plan["min_batch_s"],
                       max_batch=8)  # each call's output is another 1 GiB
    nbytes = 3 * n * 4
    out = {"elements": n, "bytes": nbytes, **timing, "gbps": nbytes / timing["seconds"] / 1e9}
    log(f"stream x*2+y over {n * 4 / 2**30:.2f} GiB arrays: {out['gbps']:.0f} GB/s")
    return out


def measure_launch(plan: dict, device_model) -> dict:
    """The launch cost of one kernel: ``launch_ops`` tiny dependent ops unrolled in one jit
    (module docstring). Also the same ops as a ``lax.fori_loop`` of 10 unrolled ops a trip, whose
    extra time a trip (a while loop's condition, its device-to-host check) the simulator does not
    model: recorded, not written into the description."""
    import jax
    import jax.numpy as jnp

    from jphantom.predict.device import Quantity
    from jphantom.predict.timeline import simulate

    ops = plan["launch_ops"]
    numbers = copy.copy(device_model.numbers)
    numbers["launch"] = {"kernel_us": Quantity(0.0, "assumed", "zero: to isolate the launch")}
    free = dataclasses.replace(device_model, numbers=numbers)

    def tiny(x):
        return x * (1.0 + 1e-6 * jnp.sum(x))

    def chain(x):
        for _ in range(ops):
            x = tiny(x)
        return x

    def looped(x):
        def body(_, x):
            for _ in range(10):
                x = tiny(x)
            return x

        return jax.lax.fori_loop(0, ops // 10, body, x)

    x = jnp.ones((plan["launch_elements"],), jnp.float32)
    out = {"ops": ops, "elements": plan["launch_elements"]}
    for name, fn in (("unrolled", chain), ("fori_loop", looped)):
        f = jax.jit(fn)
        t0 = time.perf_counter()
        hlo = f.lower(x).compile().as_text()
        compile_s = time.perf_counter() - t0
        timing = time_call(f, x, reps=max(3, plan["reps"]), min_batch_s=plan["min_batch_s"])
        timeline = simulate(hlo, free)
        kernels = max(1.0, timeline.kernels)
        out[name] = {"compile_seconds": compile_s, **timing, "kernels": timeline.kernels,
                     "modelled_without_launch_s": timeline.step,
                     "kernel_us": max(0.0, timing["seconds"] - timeline.step) / kernels * 1e6}
        log(f"launch ({name}): {ops} tiny ops -> {timeline.kernels:g} kernels, "
            f"{timing['seconds'] * 1e3:.2f} ms: {out[name]['kernel_us']:.2f} us a kernel")
    out["kernels"] = out["unrolled"]["kernels"]
    out["kernel_us"] = out["unrolled"]["kernel_us"]
    trips = ops // 10
    extra = out["fori_loop"]["seconds"] - out["fori_loop"]["kernels"] * out["kernel_us"] * 1e-6 \
        - out["fori_loop"]["modelled_without_launch_s"]
    out["while_trip_us_unmodelled"] = extra / trips * 1e6
    log(f"launch: a while trip costs {out['while_trip_us_unmodelled']:.2f} us beyond its "
        "kernels (not in the simulator)")
    return out


def measure_power(plan: dict, device) -> dict:
    """Idle and busy watts from NVML's power reading, or ``{"skipped": why}``."""
    import jax
    import jax.numpy as jnp

    if device.platform != "gpu":
        return {"skipped": f"no NVML on a {device.platform} device"}
    try:
        import pynvml
    except ImportError:
        return {"skipped": "pynvml (nvidia-ml-py) is not installed"}
    try:
        pynvml.nvmlInit()
        handle = None
        try:
            from jphantom.energy import cuda_pci_bus_id, normalise_pci_bus_id

            bus = normalise_pci_bus_id(cuda_pci_bus_id(device))
            for index in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(index)
                if normalise_pci_bus_id(pynvml.nvmlDeviceGetPciInfo(h).busId) == bus:
                    handle = h
        except Exception:  # noqa: BLE001 (match by bus failed: the first GPU)
            handle = None
        handle = handle or pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception as error:  # noqa: BLE001
        return {"skipped": f"NVML did not start: {type(error).__name__}: {error}"}

    def sample(seconds: float, busy=None) -> list[tuple[float, float]]:
        samples, stop = [], threading.Event()

        def run():
            t0 = time.perf_counter()
            while not stop.is_set():
                samples.append((time.perf_counter() - t0,
                                pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3))
                time.sleep(0.05)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        t0 = time.perf_counter()
        if busy is None:
            time.sleep(seconds)
        else:
            while time.perf_counter() - t0 < seconds:
                busy()
        stop.set()
        thread.join()
        return samples

    n = plan["reference"]
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                 preferred_element_type=jnp.bfloat16))
    jax.block_until_ready(f(a, b))

    def burst():
        out = None
        for _ in range(20):
            out = f(a, b)
        jax.block_until_ready(out)

    time.sleep(0.5)
    idle = sample(plan["idle_s"])
    busy = sample(plan["busy_s"], burst)
    settled = [w for t, w in busy if t >= 1.0] or [w for _, w in busy]
    out = {"idle_samples": idle, "busy_samples": busy,
           "idle_watts": statistics.median(w for _, w in idle),
           "busy_watts": statistics.median(settled),
           "busy_load": f"back-to-back {n}^3 bf16 GEMMs"}
    try:
        out["power_limit_watts"] = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    except Exception:  # noqa: BLE001
        pass
    pynvml.nvmlShutdown()
    log(f"power: idle {out['idle_watts']:.0f} W, busy {out['busy_watts']:.0f} W")
    return out


# ------------------------------------------------------------------------------------------------
# The description
# ------------------------------------------------------------------------------------------------


def base_description(base: str | None, device_kind: str):
    """The description whose unmeasured numbers are kept: ``base`` (a name or a path), else the
    shipped kind matching ``device_kind``, else the first of :data:`FALLBACK_DESCRIPTIONS` that
    loads (a CPU run, or a kind nothing ships yet). Returns (model, how it was chosen)."""
    from jphantom.predict import device as device_module

    if base:
        return device_module.load(base), f"--base {base}"
    try:
        found = device_module.for_kind(device_kind)
    except Exception:  # noqa: BLE001 (no shipped devices/ folder yet)
        found = None
    if found is not None:
        return found, f"shipped description matching {device_kind!r}"
    errors = []
    for name in FALLBACK_DESCRIPTIONS:
        try:
            return device_module.load(name), f"fallback {name} (none matches {device_kind!r})"
        except Exception as error:  # noqa: BLE001
            errors.append(f"{name}: {error}")
    raise SystemExit(f"no base description for {device_kind!r}: {'; '.join(errors)}; "
                     "give --base NAME|PATH")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def to_toml(data: dict) -> str:
    """A description dict (the parse() layout) as TOML: top keys, then one table per section
    of ``{ value, source, cite }`` inline tables."""
    lines = []
    for key in ("name", "description", "vendor", "device_kinds", "compile_target", "gemm_rates"):
        if key in data:
            lines.append(f"{key} = {_toml_value(data[key])}")
    for section, table in data.items():
        if not isinstance(table, dict):
            continue
        lines.append(f"\n[{section}]")
        for key, q in table.items():
            lines.append(f"{key} = {{ value = {_toml_value(q['value'])}, source = "
                         f"{_toml_value(q['source'])}, cite = {_toml_value(q['cite'])} }}")
    return "\n".join(lines) + "\n"


def describe(base, measured: dict, device_kind: str, cite: str, on_gpu: bool) -> dict:
    """The description dict: ``base``'s numbers, the measured ones over them."""
    data = {"name": f"{base.name}-measured" if on_gpu else "cpu-small-measured",
            "description": (f"{device_kind} measured by benchmarks/calibrate.py over {base.name}"
                            f" ({base.path or 'base'}): numbers labelled measured are this "
                            "card's, the rest the base's" if on_gpu else
                            f"a CPU run of benchmarks/calibrate.py --small over {base.name}: "
                            "the measured numbers are the CPU's, only the plumbing is tested"),
            "vendor": base.vendor if on_gpu else "cpu",
            "device_kinds": list(base.device_kinds) if on_gpu else ["cpu"],
            "compile_target": base.compile_target,
            "gemm_rates": ("jax/XLA: gemm_efficiency measured by benchmarks/calibrate.py with "
                           "jax.lax.dot_general on this card" if ("gemm_efficiency", "bf16")
                           in measured else base.gemm_rates)}
    for section, table in base.numbers.items():
        data[section] = {k: q.as_dict() for k, q in table.items()}
    for (section, key), (value, how) in measured.items():
        data[section][key] = {"value": value, "source": "measured", "cite": f"{cite}; {how}"}
    return data


def _fraction(value: float, what: str) -> tuple[float, str]:
    """An efficiency clamped into (0, 1] (parse() demands it), saying so when clamped."""
    if value > 1.0:
        return 1.0, f"{what}; measured {value:.4g} > 1, clamped"
    if value <= 0:
        return 1e-6, f"{what}; measured {value:.4g} <= 0, clamped"
    return value, what


def calibrate(out: Path, small: bool = False, base: str | None = None,
              budget: float = 150.0) -> dict:
    """Measure (module docstring), write ``out/<name>.toml`` and ``out/calibrate.json``; returns
    the JSON's dict (``description_path`` names the TOML). Both files are rewritten after every
    stage, so a run cut short (a timeout) leaves a valid description of what it measured."""
    import jax

    from jphantom.predict import device as device_module

    t_start = time.perf_counter()
    plan = SMALL if small else FULL
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    kind = str(getattr(device, "device_kind", device.platform))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    cite = f"{kind}, jax {jax.__version__}, {date} UTC, benchmarks/calibrate.py"
    model, chosen = base_description(base, kind)
    log(f"{kind} ({device.platform}), jax {jax.__version__}; base {model.name} ({chosen})")
    results = {"device": kind, "platform": device.platform, "jax": jax.__version__, "date": date,
               "small": small, "base": model.name, "base_path": model.path, "base_chosen": chosen,
               "plan": plan, "measured": {}, "skipped": {}, "complete": False}
    measured: dict = {}
    out.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        data = describe(model, measured, kind, cite, on_gpu)
        device_module.parse(data)  # validated before it is written
        path = out / f"{data['name']}.toml"
        path.write_text(to_toml(data))
        loaded = device_module.load(path)
        results["description_path"] = str(path)
        results["description"] = loaded.as_dict()
        results["measured"] = {f"{s}.{k}": v for (s, k), (v, _) in measured.items()}
        results["total_seconds"] = time.perf_counter() - t_start
        (out / "calibrate.json").write_text(json.dumps(results, indent=2) + "\n")

    def stage(name, fn):
        t0 = time.perf_counter()
        if t0 - t_start > budget:
            results[name] = {"skipped": f"over the {budget:g} s budget"}
            log(f"{name} skipped: over the {budget:g} s budget")
            return results[name]
        try:
            value = fn()
        except Exception as error:  # noqa: BLE001 (a stage fails: keep the base's numbers)
            value = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
            log(f"{name} failed: {value['error']}")
        if isinstance(value, dict):
            value["stage_seconds"] = time.perf_counter() - t0
        results[name] = value
        return value

    # GEMMs
    gemms = stage("gemm", lambda: measure_gemms(plan, t_start + 0.4 * budget))
    ref = plan["reference"]
    sm_count = float(getattr(device, "core_count", 0) or model["gemm_shape.sm_count"])
    if on_gpu and getattr(device, "core_count", None):
        measured[("gemm_shape", "sm_count")] = (sm_count, "jax device.core_count (SMs)")
    fit_rows = []
    for dtype in ("bf16", "fp8", "f32"):
        rows = [r for r in gemms.get(dtype, []) if "tflops" in r]
        at_ref = next((r for r in rows if (r["m"], r["n"], r["k"]) == (ref, ref, ref)), None)
        peak = model[f"peak_tflops.{dtype}"]
        if at_ref is None or peak <= 0:
            results["skipped"][f"gemm_efficiency.{dtype}"] = (
                "no datasheet peak" if peak <= 0 else f"the {ref}^3 {dtype} GEMM did not run")
            continue
        eff, how = _fraction(at_ref["tflops"] / peak,
                             f"{ref}^3 {dtype} dot_general: {at_ref['tflops']:.1f} TFLOP/s of "
                             f"{peak:g} datasheet, median of {plan['reps']} batches")
        measured[("gemm_efficiency", dtype)] = (eff, how)
        if dtype in ("bf16", "fp8"):
            fit_rows += [(r["m"], r["n"], r["k"], r["tflops"] / at_ref["tflops"])
                         for r in rows if not r["host_bound"]]
    if len(fit_rows) >= 3:
        fit = fit_k_half(fit_rows, 1.0, sm_count, model["gemm_shape.tile"], ref)
        results["k_half_fit"] = fit
        measured[("gemm_shape", "k_half")] = (
            fit["k_half"], f"least squares (log rates, grid search) of device.py's shape model "
            f"over {fit['points']} bf16/fp8 GEMM shapes relative to {ref}^3, efficiency fixed, "
            f"tile {model['gemm_shape.tile']:g}: a simple one-parameter fit")
    else:
        results["skipped"]["gemm_shape.k_half"] = f"{len(fit_rows)} usable GEMM shapes (< 3)"
    write()

    # stream bandwidth
    stream = stage("stream", lambda: measure_stream(plan))
    if "gbps" in stream:
        eff, how = _fraction(stream["gbps"] / model["memory.hbm_gbps"],
                             f"x*2+y over {stream['elements'] * 4 / 2**30:.3g} GiB float32 "
                             f"arrays: {stream['gbps']:.0f} GB/s of {model['memory.hbm_gbps']:g}")
        measured[("memory", "stream_efficiency")] = (eff, how)
    else:
        results["skipped"]["memory.stream_efficiency"] = stream.get("error") or stream.get(
            "skipped")
    write()

    # attention
    attention = stage("attention", lambda: measure_attention(plan, on_gpu))
    largest = max(plan["attention_s"])
    peak16 = model["peak_tflops.bf16"]
    for d in (64, 128):
        row = next((r for r in attention.get("rows", [])
                    if r["seq"] == largest and r["head_dim"] == d and "forward_tflops" in r), None)
        if row is None:
            results["skipped"][f"attention_efficiency.*_hd{d}"] = f"S={largest} hd{d} did not run"
            continue
        for way in ("forward", "backward"):
            eff, how = _fraction(
                row[f"{way}_tflops"] / peak16,
                f"{attention['implementation']} causal attention {way}, bf16, "
                f"B={plan['attention_bh'][0]} H={plan['attention_bh'][1]} S={largest} D={d}: "
                f"{row[f'{way}_tflops']:.1f} TFLOP/s of {peak16:g}")
            measured[("attention_efficiency", f"{way}_hd{d}")] = (eff, how)
    write()

    # power
    power = stage("power", lambda: measure_power(plan, device))
    if "busy_watts" in power:
        measured[("power", "busy_watts")] = (power["busy_watts"],
                                             f"NVML power, median over back-to-back {ref}^3 "
                                             "bf16 GEMMs")
        measured[("power", "idle_watts")] = (power["idle_watts"],
                                             f"NVML power, median over {plan['idle_s']:g} s "
                                             "idle in the process")
    else:
        results["skipped"]["power"] = power.get("skipped") or power.get("error")
    write()

    # launch (last: the longest compile)
    launch = stage("launch", lambda: measure_launch(plan, model))
    if "kernel_us" in launch:
        measured[("launch", "kernel_us")] = (
            launch["kernel_us"], f"{launch['ops']} tiny dependent ops in one jit, "
            f"{launch['kernels']:g} kernels: (time - modelled time without launch) / kernels")
    else:
        results["skipped"]["launch.kernel_us"] = launch.get("error") or launch.get("skipped")
    results["complete"] = True
    write()
    loaded = device_module.load(results["description_path"])
    log(f"wrote {results['description_path']} ({loaded.sources()}) and "
        f"{out / 'calibrate.json'} in {results['total_seconds']:.0f} s")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "calibrate"))
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU-debuggable)")
    parser.add_argument("--budget", type=float, default=150.0,
                        help="seconds: a stage starting later is skipped (its numbers kept "
                             "from the base), the GEMM grid stops at 40%% of it")
    parser.add_argument("--base", help="the description whose unmeasured numbers are kept "
                                       "(a shipped name or a path; default: the device's kind)")
    args = parser.parse_args(argv)
    results = calibrate(Path(args.out), args.small, args.base, args.budget)
    for key, value in results["measured"].items():
        print(f"  {key:<36} {value:.6g}")
    for key, why in results["skipped"].items():
        print(f"  {key:<36} kept from the base: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
