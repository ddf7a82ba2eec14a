"""Models: Flax NNX modules of computation only (Seal et al.'s FFN, GPT-2, Llama / Mixtral); every
parallel layer comes from a plan (:mod:`jphantom.plans`)."""


def packed_lm_loss(model, tokens, targets, segment_ids, positions):
    """``loss_fn`` for :func:`jphantom.make_train_step` of the zoo's language models on packed or
    padded batches ``(tokens, targets, segment_ids, positions)``, each [B, S] int32: documents
    numbered 1, 2, ... in each row (0: padding), positions restarting at 0 per document, targets
    -100 where no loss is taken. Attention stops at each document's boundary and positions
    restart (:mod:`jphantom.nn.attention.packing`); returns the global token mean's
    ``(total, weight)`` terms (:mod:`jphantom.step.token_mean`)."""
    return model.loss_terms(tokens, targets, segment_ids=segment_ids, positions=positions)


def lm_loss(model, tokens, targets, *more):
    """``loss_fn`` of the zoo's language models (for :func:`jphantom.make_train_step` and the
    programs of ``jphantom train``): the model's own ``loss`` (vocabulary-parallel cross-entropy
    when the head is; plus the MoE auxiliary losses, with the whole batch's routing fractions when
    the step splits it, :mod:`jphantom.nn.balance`); with a ``mask`` (a third batch array) the
    terms of the global token mean (:mod:`jphantom.step.token_mean`); with ``segment_ids`` and
    ``positions`` (packed or padded documents: :mod:`jphantom.data.packing`)
    :func:`packed_lm_loss`'s. The one ``lm_loss``: :func:`jphantom.models.llama.lm_loss` and
    :func:`jphantom.registry.program.lm_loss` are this function."""
    import jax.numpy as jnp

    from jphantom.errors import ConfigError

    for name, ids in (("tokens", tokens), ("targets", targets)):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ConfigError(f"{name} are {ids.dtype} values: a language model takes integer "
                              f"token ids (e.g. np.int32), not {ids.dtype}")
    if not more:
        return model.loss(tokens, targets)
    if len(more) == 1:
        return model.loss_terms(tokens, targets, more[0])
    return packed_lm_loss(model, tokens, targets, *more)


__all__ = ["lm_loss", "packed_lm_loss"]
