"""A device kind as data: peaks by dtype, GEMM and attention efficiencies, HBM, kernel launch,
the node's links and NICs, busy and idle power, each number with where it came from.

One TOML file per kind in ``jphantom/predict/devices/`` (``h100-sxm.toml``, ``h200.toml``, ...).
Every number is ``{ value = ..., source = "measured" | "datasheet" | "assumed", cite = "..." }``:
measured (device, jax, date, script), a datasheet (cited) or assumed (with the reason).
``benchmarks/calibrate.py`` writes a measured file on a lent GPU. :func:`load` reads a name or a
path; :func:`names` lists the shipped kinds; :func:`for_kind` matches jax's ``device_kind``.

How the simulator prices kernels with it (the roofline method of the scaling book, Austin et al.,
*How to Scale Your Model*, with the efficiencies measured or assumed here):

* a GEMM of F FLOPs moving M bytes takes ``max(F / (peak x eff x shape), M / (HBM x stream))``
  seconds plus one launch, where ``eff`` is the large-GEMM efficiency of its dtype and ``shape``
  the fraction of the device its tiles keep busy: ``tiles / (waves x SMs)`` (wave quantisation,
  tiles of ``tile`` x ``tile`` outputs) times ``K / (K + k_half)``, both relative to the 8192^3
  GEMM the efficiency is measured on (short reductions pay the tile's prologue and epilogue);
* a fused attention call (cuDNN's) by its FLOPs at the attention efficiency of its head size
  (forward and backward apart), linear between the listed head sizes;
* anything else by its bytes at the HBM bandwidth times ``stream_efficiency``, plus a launch.

**Whose GEMM rates.** The simulator prices the GEMMs XLA emits, so a GEMM efficiency is best
jax's own rate on the device (``h200.toml``'s, measured; ``h100-sxm.toml`` takes it, same die);
where none is on record it is derived from a library's (cuBLAS, hipBLASLt) with the derivation in
its cite, or the library's rate is kept and says so. The top-level ``gemm_rates`` string of each
description says which (optional in a file of one's own: "not stated"), and every prediction
prints it.

``[network]`` may also give ``gpus_per_package`` and ``in_package_gbps``: GPUs that share a
package (an MI250X's 2 GCDs) and the bandwidth between them, for groups that stay inside one.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import tomllib
from pathlib import Path
from typing import Any

from jphantom.errors import ConfigError

SOURCES = ("measured", "datasheet", "assumed")
DTYPES = ("bf16", "fp8", "f32")
_SECTIONS = {
    "peak_tflops": DTYPES,
    "gemm_efficiency": DTYPES,
    "gemm_shape": ("sm_count", "tile", "k_half"),
    "attention_efficiency": ("forward_hd64", "forward_hd128", "backward_hd64", "backward_hd128"),
    "memory": ("hbm_bytes", "hbm_gbps", "stream_efficiency"),
    "launch": ("kernel_us",),
    "network": ("gpus_per_node", "intra_node_gbps", "intra_node_efficiency", "intra_latency_us",
                "nics_per_node", "nic_gbps", "inter_node_efficiency", "inter_latency_us"),
    "power": ("busy_watts", "idle_watts"),
}
# Optional: GPUs that share a package and the link between them (an MI250X holds 2 GCDs joined by
# 4 Infinity Fabric links); without them every GPU of a node is its own package.
_OPTIONAL = {"network": ("gpus_per_package", "in_package_gbps")}


@dataclasses.dataclass(frozen=True)
class Quantity:
    """One number of a description and where it came from."""

    value: float
    source: str
    cite: str

    def as_dict(self) -> dict:
        return {"value": self.value, "source": self.source, "cite": self.cite}


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """A device kind (module docstring). ``numbers[section][key]`` is a :class:`Quantity`."""

    name: str
    description: str
    vendor: str
    device_kinds: tuple[str, ...]
    compile_target: str
    numbers: dict[str, dict[str, Quantity]]
    path: str = ""
    gemm_rates: str = "not stated"  # whose GEMMs gemm_efficiency measures (module docstring)

    def __getitem__(self, key: str) -> float:
        """``device["memory.hbm_gbps"]``: a number's value."""
        section, _, name = key.partition(".")
        return self.numbers[section][name].value

    def get(self, key: str, default: float | None = None) -> float | None:
        """An optional number's value (``network.gpus_per_package``), else ``default``."""
        section, _, name = key.partition(".")
        found = self.numbers.get(section, {}).get(name)
        return default if found is None else found.value

    # -- compute ---------------------------------------------------------------------------------
    def peak_flops(self, dtype: str) -> float:
        """Dense FLOP/s of ``dtype`` (bf16, fp8, f32) at the datasheet peak."""
        return self[f"peak_tflops.{dtype}"] * 1e12

    def gemm_shape_factor(self, output_elements: float, contracted: float) -> float:
        """The fraction of the large-GEMM rate a GEMM with ``output_elements`` outputs (batch
        included) and reduction length ``contracted`` reaches: wave quantisation times the
        short-K penalty, relative to K = 8192 (module docstring)."""
        sms, tile, k_half = (self[f"gemm_shape.{k}"] for k in ("sm_count", "tile", "k_half"))

        def quantisation(elements: float) -> float:
            tiles = max(1.0, math.ceil(elements / (tile * tile)))
            return tiles / (math.ceil(tiles / sms) * sms)

        k = max(1.0, contracted)
        return (quantisation(output_elements) / quantisation(8192 * 8192)
                * (k / (k + k_half)) / (8192 / (8192 + k_half)))

    def gemm_seconds(self, flops: float, nbytes: float, dtype: str, output_elements: float,
                     contracted: float) -> float:
        """A GEMM kernel's seconds (module docstring), launch included."""
        peak = self.peak_flops(dtype)
        if peak <= 0:  # no fp8 units: XLA upcasts, the bf16 rate applies
            dtype, peak = "bf16", self.peak_flops("bf16")
        rate = peak * self[f"gemm_efficiency.{dtype}"] * self.gemm_shape_factor(
            output_elements, contracted)
        return max(flops / rate, self.memory_seconds(nbytes)) + self.launch_seconds

    def attention_seconds(self, flops: float, nbytes: float, head_dim: int,
                          backward: bool) -> float:
        """A fused attention call's seconds at the attention efficiency of its head size."""
        way = "backward" if backward else "forward"
        low, high = self[f"attention_efficiency.{way}_hd64"], self[
            f"attention_efficiency.{way}_hd128"]
        t = min(1.0, max(0.0, (head_dim - 64) / 64))
        eff = low + t * (high - low)
        if head_dim < 64:
            eff = low * head_dim / 64
        rate = self.peak_flops("bf16") * eff
        return max(flops / rate, self.memory_seconds(nbytes)) + self.launch_seconds

    @property
    def has_fp8(self) -> bool:
        """Whether the device has FP8 GEMM units (``peak_tflops.fp8`` > 0)."""
        return self["peak_tflops.fp8"] > 0

    def check_precision(self, precision: str) -> None:
        """Refuse to price a ``precision`` the device cannot run as compiled: FP8 GEMMs on a device
        without FP8 units (an A100, an MI250X), which the simulator would price at the bf16 rate
        of a program it does not have. One ConfigError naming the device, its file and the fix."""
        if str(precision).lower() == "fp8" and not self.has_fp8:
            fp8 = sorted(n for n in names() if load(n).has_fp8)
            raise ConfigError(
                f"--precision fp8 on {self.name} ({self.path or 'its description'}): it has no FP8 "
                f"GEMMs ([peak_tflops] fp8 = 0), so the program's FP8 GEMMs have no rate there: "
                f"predict on a device with them ({', '.join(fp8)}) or use --precision bf16")

    # -- memory ----------------------------------------------------------------------------------
    @property
    def stream_bytes_per_second(self) -> float:
        return self["memory.hbm_gbps"] * 1e9 * self["memory.stream_efficiency"]

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` through HBM at the sustained bandwidth (no launch)."""
        return nbytes / self.stream_bytes_per_second

    @property
    def launch_seconds(self) -> float:
        return self["launch.kernel_us"] * 1e-6

    @property
    def memory_bytes(self) -> float:
        return self["memory.hbm_bytes"]

    # -- record ----------------------------------------------------------------------------------
    def sources(self) -> dict[str, int]:
        """How many numbers are measured, from a datasheet, assumed."""
        counts = dict.fromkeys(SOURCES, 0)
        for section in self.numbers.values():
            for q in section.values():
                counts[q.source] += 1
        return counts

    def as_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "vendor": self.vendor,
                "device_kinds": list(self.device_kinds), "compile_target": self.compile_target,
                "gemm_rates": self.gemm_rates,
                "path": self.path, "sources": self.sources(),
                **{s: {k: q.as_dict() for k, q in v.items()} for s, v in self.numbers.items()}}


def _quantity(where: str, raw: Any) -> Quantity:
    if not isinstance(raw, dict) or set(raw) != {"value", "source", "cite"}:
        raise ConfigError(f"{where}: give {{ value = ..., source = \"measured\" | \"datasheet\" | "
                          f"\"assumed\", cite = \"...\" }}, not {raw!r}")
    value, source, cite = raw["value"], raw["source"], raw["cite"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value < 0:
        raise ConfigError(f"{where}: value {value!r} must be a finite number >= 0")
    if source not in SOURCES:
        raise ConfigError(f"{where}: source {source!r} must be one of {', '.join(SOURCES)}")
    if not isinstance(cite, str) or not cite.strip():
        raise ConfigError(f"{where}: cite must say where the number came from")
    return Quantity(float(value), source, cite)


# The one rule every reader of a description (compile --predict, plan, the simulator) relies on:
# a fraction in (0, 1], a count a whole number >= 1, a rate, size or power > 0 (module docstring).
_FRACTIONS = {"memory": ("stream_efficiency",),
              "network": ("intra_node_efficiency", "inter_node_efficiency")}
_COUNTS = {"gemm_shape": ("sm_count", "tile"), "network": ("gpus_per_node", "nics_per_node")}
_POSITIVE = {"peak_tflops": ("bf16", "f32"), "memory": ("hbm_bytes", "hbm_gbps"),
             "network": ("intra_node_gbps", "nic_gbps"), "power": ("busy_watts",)}


def _check_numbers(numbers: dict, where: str) -> None:
    """Every number the simulator and the planner divide by or count with, checked once here
    (a ConfigError naming the file, the table and the field)."""
    for section, keys in _FRACTIONS.items():
        for k in keys:
            if not 0 < numbers[section][k].value <= 1:
                raise ConfigError(f"{where} [{section}] {k} = {numbers[section][k].value:g}: "
                                  "a fraction in (0, 1]")
    for section, keys in _COUNTS.items():
        for k in keys:
            value = numbers[section][k].value
            if value < 1 or not value.is_integer():
                raise ConfigError(f"{where} [{section}] {k} = {value:g}: a whole number >= 1")
    for section, keys in _POSITIVE.items():
        for k in keys:
            if numbers[section][k].value <= 0:
                raise ConfigError(f"{where} [{section}] {k} = {numbers[section][k].value:g}: "
                                  "must be > 0")


def parse(data: dict, where: str = "device description") -> DeviceModel:
    """A :class:`DeviceModel` from a description's parsed TOML (checked: every section and key
    present, every number a Quantity; efficiencies in (0, 1], counts whole numbers >= 1, rates,
    sizes and busy power > 0: :func:`_check_numbers`, the one rule ``compile --predict`` and
    ``plan`` both read descriptions by)."""
    for key in ("name", "description", "vendor", "device_kinds", "compile_target"):
        if key not in data:
            raise ConfigError(f"{where}: no {key!r}")
    numbers = {}
    for section, keys in _SECTIONS.items():
        table = data.get(section)
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: no [{section}] table")
        missing = [k for k in keys if k not in table]
        if missing:
            raise ConfigError(f"{where}: [{section}] lacks {', '.join(missing)}")
        numbers[section] = {k: _quantity(f"{where} [{section}] {k}", table[k])
                            for k in keys + tuple(k for k in _OPTIONAL.get(section, ())
                                                  if k in table)}
    for section in ("gemm_efficiency", "attention_efficiency"):
        for k, q in numbers[section].items():
            if not 0 < q.value <= 1:
                raise ConfigError(f"{where} [{section}] {k} = {q.value}: an efficiency is a "
                                  "fraction in (0, 1]")
    _check_numbers(numbers, where)
    package = numbers["network"].get("gpus_per_package")
    if package is not None and (not package.value.is_integer() or package.value < 1 or (
            numbers["network"]["gpus_per_node"].value % package.value)):
        raise ConfigError(f"{where} [network] gpus_per_package = {package.value:g}: a whole "
                          "number of GPUs that divides gpus_per_node")
    if (package is None) != ("in_package_gbps" not in numbers["network"]):
        raise ConfigError(f"{where} [network]: give gpus_per_package and in_package_gbps "
                          "together (or neither)")
    rates = data.get("gemm_rates", "not stated")
    if not isinstance(rates, str) or not rates.strip():
        raise ConfigError(f"{where}: gemm_rates must say whose GEMMs gemm_efficiency measures "
                          "(e.g. \"jax/XLA, measured with benchmarks/calibrate.py\")")
    return DeviceModel(str(data["name"]), str(data["description"]), str(data["vendor"]),
                       tuple(str(k).lower() for k in data["device_kinds"]),
                       str(data["compile_target"]), numbers, gemm_rates=rates)


def _shipped() -> Any:
    return importlib.resources.files("jphantom.predict").joinpath("devices")


def names() -> list[str]:
    """The shipped device kinds (file stems), sorted."""
    return sorted(p.name[:-5] for p in _shipped().iterdir() if p.name.endswith(".toml"))


def load(name_or_path: str | Path) -> DeviceModel:
    """A shipped kind by name (``h100-sxm``) or a description file by path."""
    text = str(name_or_path)
    if Path(text).is_dir():
        found = sorted(p.name for p in Path(text).glob("*.toml"))
        raise ConfigError(f"--device {text} is a folder: give a device description TOML file"
                          + (f" in it ({', '.join(found[:5])})" if found else "")
                          + f" or one of {', '.join(names())}")
    if text.endswith(".toml") or "/" in text:
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"--device {text}: no such file (give a device description TOML "
                              f"or one of {', '.join(names())})")
        raw, where = path.read_text(), str(path)
    else:
        if text not in names():
            raise ConfigError(f"--device {text!r}: known devices are {', '.join(names())} (or "
                              "give a description file, e.g. one benchmarks/calibrate.py wrote)")
        raw, where = _shipped().joinpath(f"{text}.toml").read_text(), f"{text}.toml"
    try:
        data = tomllib.loads(raw)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{where}: not TOML ({error})") from None
    return dataclasses.replace(parse(data, where), path=where)


def for_target(target: str) -> DeviceModel:
    """The shipped description of a compile target (``gpu:h100`` -> ``h100-sxm``)."""
    for name in names():
        found = load(name)
        if found.compile_target == target:
            return found
    raise ConfigError(f"no shipped device description compiles as {target}: give --device "
                      f"({', '.join(names())} or a TOML file)")


def for_kind(device_kind: str) -> DeviceModel | None:
    """The shipped description whose ``device_kinds`` name jax's ``device_kind`` (the first
    substring found), else None."""
    kind = device_kind.lower()
    for name in names():
        found = load(name)
        if any(k in kind for k in found.device_kinds):
            return found
    return None
