"""`python -m ckptd` runs the command line."""

from ckptd.cli.main import main

raise SystemExit(main())
