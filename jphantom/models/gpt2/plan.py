"""GPT-2's parallel plan, declared by path (the family's plan hook, :attr:`jphantom.registry.families.Family.
plan`), as torchtitan's ``parallelize_llama`` declares Llama's: which layer of a block is a column
or a row of Megatron's pairs (Shoeybi et al. 2019), which norm opens a tensor-parallel region
(or, under sequence parallelism, gathers the sequence; Korthikanti et al. 2022), where the
vocabulary is split, and the routed experts of an MoE block (TED, Singh's thesis ch. 7).

A block (``blocks.block``, or an MoE group's ``dense.i`` and ``moe_block``):

==============  ===============================  =====================================
path            without sequence parallelism     with it
==============  ===============================  =====================================
``ln_1``        ``input`` (f: one all-reduce     ``sequence`` (all-gather the sequence)
                of its backward for qkv)
``attn.qkv``    ``column``                       ``column``
``attn.out``    ``row`` (g)                      ``row`` (reduce-scatter the sequence)
``ln_2``        ``input``; ``replicate`` before  ``sequence``; ``replicate`` before the
                the router                       router
``mlp.up``      ``column``                       ``column``
``mlp.down``    ``row``                          ``row``
``moe``         ``experts`` (``dtd``: TED)       ``experts``
==============  ===============================  =====================================

and ``wte`` (and an untied ``head``) ``vocab``, ``wpe`` ``replicate`` (``sequence``), ``ln_f``
``input`` (``sequence``). ``collective_matmul`` rings the row layers' and the norms' collectives
(Wang et al. 2023). Phantom and pmm3d give every layer their one style: the walkers'
(:mod:`jphantom.plans`), not this plan. ``tests/models/test_families.py`` checks this declaration
against the walker of :func:`jphantom.plans.megatron` on every variant.
"""

from __future__ import annotations

from jphantom.plans import Style


def plan(model, *, sequence_parallel: bool = False, dtd: bool = False,
         collective_matmul: bool = False, **_):
    """GPT-2's Megatron plan (``tensor`` applies it, ``gspmd`` annotates it:
    :mod:`jphantom.registry.layer_plans`)."""
    config = model.config
    norm = "sequence" if sequence_parallel else "input"
    ringed = lambda name: Style(name, collective_matmul=True) if collective_matmul else name
    out = {"wte": "vocab", "wpe": "sequence" if sequence_parallel else "replicate", "ln_f": norm}
    if not config.tied_head:
        out["head"] = "vocab"
    if config.moe_every:
        prefixes = [f"blocks.block.dense.{i}" for i in range(config.moe_every - 1)]
        moe = "blocks.block.moe_block"
    else:
        prefixes, moe = ["blocks.block"], None
    for prefix in prefixes + ([moe] if moe else []):
        out |= {f"{prefix}.ln_1": ringed(norm), f"{prefix}.attn.qkv": "column",
                f"{prefix}.attn.out": ringed("row")}
        if prefix == moe:  # the router reads the whole sequence on every rank
            out |= {f"{prefix}.ln_2": "replicate", f"{prefix}.moe": Style("experts", dtd=dtd)}
        else:
            out |= {f"{prefix}.ln_2": ringed(norm), f"{prefix}.mlp.up": "column",
                    f"{prefix}.mlp.down": ringed("row")}
    return out
