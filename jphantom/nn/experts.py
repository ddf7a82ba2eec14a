"""Deprecated: this module is :mod:`jphantom.nn.moe` (renamed so that the three expert modules,
``expert``, ``experts`` and ``tensor.experts``, no longer read alike). The old name goes in
the next release."""

import sys
import warnings

from jphantom.nn import moe

sys.modules[__name__] = moe
warnings.warn("jphantom.nn.experts is now jphantom.nn.moe; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
