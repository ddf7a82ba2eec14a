"""The Llama family's parallel plan, declared by path (the family's plan hook,
:attr:`jphantom.registry.families.Family.plan`), as torchtitan's ``parallelize_llama`` declares it, for
every variant the family registers (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 3):

=====================================  =================================  ======================
path (``layers.block.``...)            Megatron (Shoeybi et al. 2019)     under sequence
                                                                          parallelism
=====================================  =================================  ======================
``input_layernorm``                    ``input`` (f for q, k, v)          ``sequence``
``self_attn.q_proj``                   ``column``                         ``column``
``self_attn.k_proj``, ``v_proj``       ``column`` by key/value head       the same
                                       (``kv_heads``: heads repeated
                                       where ranks outnumber them)
``self_attn.q_norm``, ``k_norm``       ``replicate`` (a whole head each)  the same
``self_attn.o_proj``                   ``row`` (g)                        ``row`` (scatter)
``post_attention_layernorm``           ``input``; Gemma's post-norm       ``sequence``; the same
                                       ``replicate``
``pre_feedforward_layernorm`` (Gemma)  ``input``                          ``sequence``
``post_feedforward_layernorm`` (Gemma) ``replicate``                      the same
``mlp.gate_proj``, ``up_proj``         ``column``                         ``column``
``mlp.down_proj``                      ``row``                            ``row``
``moe.router`` / ``moe.experts``       ``replicate`` / ``experts``        the same
=====================================  =================================  ======================

and ``embed_tokens`` (and an untied ``lm_head``) ``vocab``, the final ``norm`` ``input``
(``sequence``). ``collective_matmul`` rings the row layers' and the dense blocks' norms'
collectives (Wang et al. 2023; Korthikanti et al. 2022 for the sequence split). Phantom and
pmm3d give every layer their one style: the walkers'. ``tests/models/test_families.py`` checks
this declaration against :func:`jphantom.plans.megatron`'s walker on every variant.
"""

from __future__ import annotations

from jphantom.plans import Style


def plan(model, *, sequence_parallel: bool = False, dtd: bool = False,
         collective_matmul: bool = False, **_):
    """The Llama family's Megatron plan (``tensor`` applies it, ``gspmd`` annotates it:
    :mod:`jphantom.registry.layer_plans`); ``None`` (the walker's) for Gemma's post-norms with experts,
    which no registered variant has."""
    config = model.config
    if config.post_norms and config.experts:
        return None
    norm = "sequence" if sequence_parallel else "input"
    ringed = lambda name: Style(name, collective_matmul=True) if collective_matmul else name
    block = "layers.block"
    out = {"embed_tokens": "vocab", "norm": norm,
           f"{block}.input_layernorm": ringed(norm),
           f"{block}.self_attn.q_proj": "column",
           f"{block}.self_attn.k_proj": Style("column", kv_heads=config.kv_heads),
           f"{block}.self_attn.v_proj": Style("column", kv_heads=config.kv_heads),
           f"{block}.self_attn.o_proj": ringed("row")}
    if not config.tie_word_embeddings:
        out["lm_head"] = "vocab"
    if config.qk_norm:
        out |= {f"{block}.self_attn.q_norm": "replicate", f"{block}.self_attn.k_norm": "replicate"}
    if config.experts:  # the router reads every token's features; dropless experts
        return out | {f"{block}.post_attention_layernorm": norm,
                      f"{block}.moe.router": "replicate", f"{block}.moe.experts": "experts"}
    if config.post_norms:  # Gemma: norms after attention and the MLP, one before the MLP
        out |= {f"{block}.post_attention_layernorm": "replicate",
                f"{block}.pre_feedforward_layernorm": ringed(norm),
                f"{block}.post_feedforward_layernorm": "replicate"}
    else:
        out[f"{block}.post_attention_layernorm"] = ringed(norm)
    return out | {f"{block}.mlp.gate_proj": "column", f"{block}.mlp.up_proj": "column",
                  f"{block}.mlp.down_proj": ringed("row")}
