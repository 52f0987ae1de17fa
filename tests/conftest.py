"""Shared fixtures live in tests/support (see support.fixtures); this file only loads them."""

from __future__ import annotations

import os

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

pytest_plugins = ["support.fixtures"]

# The real-framework suite needs its own environment (`make test-frameworks`).
collect_ignore = [] if os.environ.get("CKPTD_FRAMEWORKS") == "1" else ["frameworks"]
