"""The planner's ranking as text: the table of layouts, the top choice and every assumption
(Singh's thesis Eqs. 5.1-5.7 named as the model)."""

from __future__ import annotations

from jphantom.perf.axonn_model import BLOCKS, GPT2_BLOCKS
from jphantom.planner.result import Ranking


def per_token(joules: float) -> str:
    """Joules per token for a table: 4 decimals from 0.01 J up, 3 significant figures below
    (``0.00729``, ``2.5e-05``), never ``0.0000`` for a non-zero energy."""
    return f"{joules:.4f}" if joules >= 0.01 or joules == 0 else f"{joules:.3g}"


def _nodes(devices: int, nodes: int, per_node: int) -> str:
    """How the GPUs sit on nodes: "32 GPUs = 8 node(s) x 4", "1 GPU of one 4-GPU node"."""
    if devices % per_node == 0:
        return f"{devices} GPUs = {nodes} node(s) x {per_node}"
    if devices < per_node:
        return f"{devices} GPU{'s' if devices > 1 else ''} of one {per_node}-GPU node"
    return (f"{devices} GPUs on {nodes} nodes of {per_node} ({devices % per_node} on the "
            "last)")


def format_plan(result: Ranking, top: int = 10) -> str:
    """The ranking as a text table, the top choice and the assumptions."""
    a = result.assumptions
    m, t = a["model"], a["topology"]
    kind = BLOCKS.get(m.get("family"), GPT2_BLOCKS)
    table = t["intra_node_table"]
    intra = (", ".join(f"({key}) {v:g}" for key, v in table.items())
             + f", else {t['intra_node_gbps']:g}") if table else f"{t['intra_node_gbps']:g}"
    fitting = sum(r.fits is not False for r in result.rows)
    source = a.get("memory_source")
    limit = (f"{fitting} of {len(result.rows)} fit in {a['memory_gib']:g} GiB"
             + (f" ({source})" if source and source != "given" else "")
             if a["memory_gib"] is not None else f"{len(result.rows)} priced, no memory limit")
    lines = [
        (f"{ {'llama': 'Llama'}.get(m.get('model'), m.get('model'))} L={m['layers']}, h={m['hidden']}, heads={m['heads']} ({m['kv_heads']} key/"
         f"value), SwiGLU {m['intermediate']}, " if kind.sized else
         f"GPT L={m['layers']}, h={m['hidden']}, heads={m['heads']}, ")
        + f"S={m['seq_len']}, V={m['vocab_size']} ({m['parameters'] / 1e9:.2f}B parameters); batch "
        f"{a['batch_sequences']} sequences ({a['tokens_per_step']:,} tokens) per step"
        + (f", {a['accumulate']} accumulation micro-batches (a layout whose batch per data rank is "
           f"no multiple of {a['accumulate']} is left out)" if a["accumulate"] > 1 else "")
        + f"; {_nodes(a['devices'], a['nodes'], t['gpus_per_node'])}.",
        f"Network ({t['name']}): beta_inter {t['inter_node_gbps']:g} GB/s between nodes; intra-node"
        f" GB/s by (G0,G1): {intra}; alpha {t['latency_us']:g} us per ring step"
        + ("" if a["latency"] else " (off: Singh's model exactly)") + ".",
        f"{a['precision']['name']}: {a['precision']['message_bytes']}-byte messages, "
        f"{a['precision']['state_bytes_per_parameter']} bytes of state per parameter; "
        + (f"phantom k={a['ghost_width']}" if kind.phantom else
           "no phantom layouts (GPT-2 blocks only)")
        + f"; pipeline bubble priced at {a['device_tflops']:g} TFLOP/s. "
        f"Layouts: {limit}.",
        f"Ranked by {a['ranking']} (communication: Singh's thesis Eqs. 5.1-5.7, ring "
        "alpha-beta); memory modelled.",
    ]
    priced = a.get("objective", "comm") in ("time", "energy")
    if priced:
        p = a["power_watts"]
        lines.append(f"Compute at {a['device_tflops']:.0f} TFLOP/s per GPU, energy by Seal et "
                     f"al.'s Eq. 1 at A = {p['busy']:g} W busy, B = {p['idle']:g} W idle "
                     f"({p['source']}); all modelled.")
    lines += ["", f"{'rank':>4}  {'strategy':<14} {'mesh':<24} {'variant':<14} {'comm s':>8} "
              f"{'bubble s':>8} {'TFLOP/dev':>9} {'mem GiB':>7}  fits"
              + (f" {'step s':>7} {'J/token':>8}" if priced else "")]
    shown = result.rows[:top]
    for row in shown:
        fits = "-" if row.fits is None else ("yes" if row.fits else "no")
        bubble = f"{row.bubble_s:8.3f}" if row.bubble_s else f"{'-':>8}"
        lines.append(f"{row.rank:>4}  {row.layout:<14} {row.mesh:<24} {row.variant:<14} "
                     f"{row.comm_s:8.3f} {bubble} {row.flops_per_device / 1e12:9.1f} "
                     f"{row.memory_gib:7.1f}  {fits:<4}"
                     + (f" {row.step_s:7.3f} {per_token(row.joules_per_token):>8}" if priced else ""))
    if any(not row.same_model for row in shown):
        lines.append("   * phantom trains a different, smaller model (Seal et al.): listed, never "
                     "the top choice")
    best = result.top
    axes = ", ".join(f"{axis} {s:.3f} s" for axis, s in best.comm_by_axis.items())
    verdict = ("" if best.fits is not False
               else " (nothing fits: the least communication among those that do not)")
    variant = f" ({best.variant})" if best.variant else ""
    lines += ["", f"Top choice{verdict}: rank {best.rank}, {best.layout} on {best.mesh}{variant}, "
              f"{best.key_s:.3f} s modelled per step ({axes or 'no communication'}), "
              f"{best.memory_gib:.1f} GiB per GPU"
              + (f"; {best.step_s:.3f} s per step with compute, {per_token(best.joules_per_token)} "
                 "J/token" if priced else "") + "."]
    if a.get("objective") == "energy":
        lines += ["", "Time/energy Pareto front (no layout that fits is both faster and cheaper):"]
        for row in result.pareto():
            lines.append(f"  rank {row.rank:>3}  {row.layout:<14} {row.mesh:<24} "
                         f"{row.step_s:7.3f} s/step  {per_token(row.joules_per_token):>8} J/token")
    lines.append("Not modelled: " + a["not_modelled"] + ".")
    return "\n".join(lines)
