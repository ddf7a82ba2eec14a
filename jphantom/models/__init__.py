"""Models: Flax NNX modules of computation only (Seal et al.'s FFN, GPT-2, Llama / Mixtral); every
parallel layer comes from a plan (:mod:`jphantom.plans`)."""


def packed_lm_loss(model, tokens, targets, segment_ids, positions):
    """``loss_fn`` for :func:`jphantom.make_train_step` of the zoo's language models on packed or
    padded batches ``(tokens, targets, segment_ids, positions)``, each [B, S] int32: documents
    numbered 1, 2, ... in each row (0: padding), positions restarting at 0 per document, targets
    -100 where no loss is taken. Attention stops at each document's boundary and positions
    restart (:mod:`jphantom.nn.attention.packing`); returns the global token mean's
    ``(total, weight)`` terms (:mod:`jphantom.token_mean`)."""
    return model.loss_terms(tokens, targets, segment_ids=segment_ids, positions=positions)


__all__ = ["packed_lm_loss"]
