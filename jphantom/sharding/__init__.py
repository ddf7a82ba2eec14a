"""How computation is split across devices: one module per parallel strategy.

- :mod:`jphantom.sharding.dense`: the unsharded reference FFN and transformer layers, and their
  GSPMD-annotated variants.
- :mod:`jphantom.sharding.tensor`: tensor parallelism, seed 000's T1 and Megatron's column/row
  pairs with f and g (FFN and transformer, with sequence parallelism).
- :mod:`jphantom.sharding.phantom` and :mod:`.phantom_transformer`: phantom parallelism (seed 000).
- :mod:`jphantom.sharding.vocab`: vocabulary-parallel embedding and cross-entropy.
- :mod:`jphantom.sharding.zero`: ZeRO-1/2/3 on the data axis.
- :mod:`jphantom.sharding.expert`: the expert-parallel MoE layer (TED, DTD).

Layers here run per rank inside the step's ``shard_map`` (:func:`jphantom.step.sharded`) and call
their collectives on the mesh axes they are given; none opens a shard_map of its own.
"""
