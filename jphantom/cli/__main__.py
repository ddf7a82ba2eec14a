"""``python -m jphantom.cli ...``: the ``jphantom`` command (:func:`jphantom.cli.main`)."""

import sys

from jphantom.cli import main

sys.exit(main())
