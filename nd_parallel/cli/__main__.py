"""`python -m nd_parallel.cli ...` is the `nd-parallel` command."""

import sys

from .main import main

sys.exit(main())
