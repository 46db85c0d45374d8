"""`python -m flowrl` runs the command line."""

import sys

from flowrl.cli import main

sys.exit(main())
