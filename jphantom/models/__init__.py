"""Models: Flax NNX modules of computation only (Seal et al.'s FFN, GPT-2, Llama / Mixtral); every
parallel layer comes from a plan (:mod:`jphantom.plans`)."""
