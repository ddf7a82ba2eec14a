"""How computation is split across devices: one module per parallel strategy.

- :mod:`jphantom.sharding.dense`: the unsharded reference FFN (and its GSPMD-sharded variant).
- :mod:`jphantom.sharding.phantom`: phantom parallelism (seed 000, Seal et al.).
- :mod:`jphantom.sharding.tensor`: tensor-parallel baselines T1 (row-sharded, all-gather) and T2
  (Megatron column/row pairs with the f/g conjugate operators).

Every strategy exposes the same functional shape: ``init(key, *, width, ..., dtype)`` returning a list
(one entry per layer) of dicts of global arrays, ``forward(params, x, mesh, *, axis=...)`` taking and
returning ``[batch, width]`` activations sharded on features, and ``dense_equivalent(params)`` giving
the mathematically identical dense layers used as the single-device oracle.
"""
