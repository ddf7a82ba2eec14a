"""Models: Flax NNX modules of computation only (seed 000's FFN, GPT-2, Llama / Mixtral); every
parallel layer comes from a plan (:mod:`jphantom.plans`)."""
