"""The runtime: the devices and processes a program runs on: the mesh and its named axes (mesh.py);
the collectives every per-rank layer calls over them (comm.py); PCCL's hierarchical all-gather
and reduce-scatter (collectives.py); multi-process start-up and the checks jax lacks
(distributed.py, coordinator.py); a GPU run's XLA flags and allocator setting (gpu_defaults.py);
``jphantom launch``, N local processes (launch.py); what a run does when the cluster or its user
stops it (resilience.py)."""
