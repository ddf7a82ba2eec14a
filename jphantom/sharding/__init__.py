"""Per-rank operations of the parallel layers: the maths each :mod:`jphantom.nn` layer runs on one
rank inside the training step's ``shard_map``, with its collectives on the mesh axes it is given.

- :mod:`jphantom.sharding.phantom`: phantom parallelism's layer (Seal et al.), a ``custom_vjp`` with
  the paper's backward operators, and its shape rules (Eq. 8).
- :mod:`jphantom.sharding.pmm3d`: AxoNN's 3D matrix multiply (Singh's thesis ch. 5, Algorithm 3).
- :mod:`jphantom.sharding.expert`: top-k routing, capacity, dispatch and combine of the MoE layers.
- :mod:`jphantom.sharding.vocab`: vocabulary-parallel embedding and cross-entropy.
- :mod:`jphantom.sharding.zero`: ZeRO-1/2/3 on the data axis (what the step shards, the gathers).
- :mod:`jphantom.sharding.collectives`: hierarchical all-gather / reduce-scatter.

None opens a shard_map of its own.
"""
