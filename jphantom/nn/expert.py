"""Deprecated: this module is :mod:`jphantom.nn.expert_parallel` (renamed so that the three expert modules,
``expert``, ``experts`` and ``tensor.experts``, no longer read alike). The old name goes in
the next release."""

import sys
import warnings

from jphantom.nn import expert_parallel

sys.modules[__name__] = expert_parallel
warnings.warn("jphantom.nn.expert is now jphantom.nn.expert_parallel; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
