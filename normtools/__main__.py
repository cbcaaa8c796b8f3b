import sys

from normtools.cli import main

sys.exit(main())
