"""`python -m ckptd` runs the command line."""

from ckptd.cli import main

raise SystemExit(main())
