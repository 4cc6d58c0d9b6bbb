"""`python -m fullband.cli`: the `fullband` command."""
from fullband.cli import main

raise SystemExit(main())
