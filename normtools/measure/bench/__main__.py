"""``python -m normtools.measure.bench``: the same options as ``normtools bench``."""

import sys

from normtools.measure.bench.cli import main

sys.exit(main())
