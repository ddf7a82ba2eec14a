"""The attention settings' choices, as names: :data:`ALGORITHMS`, how context parallelism attends
across the ``context`` mesh axis (``--context-attention``), and :data:`IMPLEMENTATIONS`, the kernel
of the unsplit attention core (``--attention``). :mod:`jphantom.nn.attention` implements them and
takes its names from here; a run's configuration (:mod:`jphantom.config`) and the command line
check a setting against them without importing jax (:mod:`jphantom.nn` imports it)."""

ALGORITHMS = ("ring", "all-gather")
"""Context attention: K/V chunks passed around the ring of ``context`` ranks (the default), or K
and V all-gathered (:mod:`jphantom.nn.attention.context`)."""

IMPLEMENTATIONS = ("auto", "xla", "cudnn")
"""The unsplit core's kernel: ``auto`` (cuDNN's flash attention where it can run, else XLA's
path), ``xla`` or ``cudnn`` (:mod:`jphantom.nn.attention.kernel_choice`)."""
