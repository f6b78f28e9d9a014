"""The ``clinfed`` command's entry point (``python cli.py ...`` from a checkout).

The commands live in :mod:`clinfed.commands`, one module per group; the
installed console script calls the same :func:`clinfed.commands.main`.
"""

import sys

from clinfed.commands import main

if __name__ == "__main__":
    sys.exit(main())
