"""The real-framework suite: checkpoints written by the frameworks themselves (pinned in
requirements.txt beside this file). Run with `make test-frameworks`; `make test` leaves this
directory out (its libraries are not in the main environment)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
