"""Know before you rent: a training step's time, memory and energy predicted from the program XLA
compiled for the target, on a modelled device and network.

``jphantom compile`` gives the optimised HLO of the real step for H100/H200/A100 nodes on a
CPU-only machine; this package plays it:

- :mod:`~jphantom.predict.device`: a device kind as data (``devices/*.toml``: peaks by dtype,
  GEMM and attention efficiencies, HBM, launch cost, links, NICs, busy and idle power), every
  number measured, from a datasheet or assumed, and saying which;
- :mod:`~jphantom.predict.costs`: what each kernel costs (GEMMs and fused attention by FLOPs at
  their efficiency, everything else by its bytes at the HBM bandwidth: the scaling book's
  roofline, plus a launch);
- :mod:`~jphantom.predict.network`: a collective's seconds as NCCL's ring or tree on the
  group's placement (NVLink inside a node, the NICs across);
- :mod:`~jphantom.predict.timeline`: the schedule XLA chose, played on a compute stream and a
  collective stream (async collectives overlap the compute between their start and done; loops
  times their trip counts);
- :mod:`~jphantom.predict.report`: the :class:`Prediction` (compute, exposed and hidden
  communication, MFU, tokens/s per GPU, compiled peak memory, joules per step and per token by
  Seal et al.'s Eq. 1).

Why a simulator of our own: XLA's GPU cost analysis returns nothing for an ahead-of-time target
(``cost_analysis()`` is None on this path), its latency estimators are scheduling aids, and the
published simulators read PyTorch traces (ASTRA-sim's Chakra, Lumos) or the framework's own
workload description (SimAI); none reads XLA's scheduled program or predicts energy.
Every number it prints is modelled; ``benchmarks/predict_validation.py`` gives its measured error.
"""

_LAZY = {"DeviceModel": "device", "Quantity": "device", "for_kind": "device", "load": "device",
         "names": "device", "Network": "network", "GroupPlacement": "network",
         "Prediction": "report", "format_prediction": "report", "predict": "report",
         "Simulator": "timeline", "Timeline": "timeline", "simulate": "timeline"}
__all__ = sorted(_LAZY)


def __getattr__(name):
    """The names above load on first use, so that reading the device descriptions (the CLI's
    help lists them) imports neither jax nor numpy."""
    import importlib

    if name == "Placement":  # GroupPlacement's old name, not jphantom.plans.Placement
        import warnings

        warnings.warn("jphantom.predict: Placement is now GroupPlacement; the old name goes in "
                      "the next release", DeprecationWarning, stacklevel=2)
        name = "GroupPlacement"
    if name not in _LAZY:
        raise AttributeError(f"module 'jphantom.predict' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jphantom.predict.{_LAZY[name]}"), name)
