"""``python -m jphantom ...``: the ``jphantom`` command (:func:`jphantom.cli.main`), for machines
where the package is on the path but not installed (a source tree with ``PYTHONPATH=.``)."""

import sys

from jphantom.cli import main

sys.exit(main())
