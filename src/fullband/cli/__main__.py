"""`python -m fullband.cli`: the `fullband` command."""

import sys

from fullband.cli import main

sys.exit(main())
