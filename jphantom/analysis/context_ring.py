"""Whether context parallelism hides its ring, read from a compiled program: ring attention's
(Liu, Zaharia & Abbeel 2023; Megatron-LM's context parallelism) collective-permutes over
``context`` with what the schedule runs under each (:func:`jphantom.analysis.hlo.overlap.ring_overlap`:
an attention kernel, or not), and what :mod:`jphantom.predict`'s timeline makes of them: the
seconds the compute stream waits on them (exposed) and their transfer time (:func:`ring_report`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from jphantom.analysis.hlo.overlap import ring_overlap


def ring_report(hlo_text: str, axes: Mapping[str, int], device=None, *,
                gpus_per_node: int | None = None,
                node_of: Callable[[int], int] | None = None, axis: str = "context") -> dict:
    """:func:`~jphantom.analysis.hlo.overlap.ring_overlap` of the optimised, scheduled module
    ``hlo_text`` on a mesh of ``axes`` and, given a :class:`jphantom.predict.DeviceModel`
    ``device``, the program played on it (:func:`jphantom.predict.timeline.simulate`):
    ``predicted`` holds ``step_s``, ``exposed_comm_s`` (every collective), ``ring_exposed_s``
    (the compute stream waiting on the ring's permutes), ``ring_comm_s`` (their transfer time)
    and per window ``exposed_s``."""
    out = ring_overlap(hlo_text, axes, axis)
    if device is None:
        return out
    from jphantom.predict.network import Network
    from jphantom.predict.timeline import simulate

    devices = 1
    for size in axes.values():
        devices *= size
    timeline = simulate(hlo_text, device, Network.of(device, gpus_per_node), devices=devices,
                        node_of=node_of)
    for window in out["windows"]:
        window["exposed_s"] = timeline.waits.get(window["name"], 0.0)
    out["predicted"] = {
        "step_s": timeline.step, "exposed_comm_s": timeline.exposed,
        "ring_exposed_s": sum(w["exposed_s"] for w in out["windows"]),
        "ring_comm_s": sum(timeline.ops[w["name"]][1] for w in out["windows"]
                           if w["name"] in timeline.ops)}
    return out
