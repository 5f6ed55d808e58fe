"""`python -m batchstate`: the same command line as the installed `batchstate`."""

import sys

from batchstate.cli import main

sys.exit(main())
