"""Numbers from outside that no machine type holds. Holds no tests."""

from __future__ import annotations

HUGE = "9" * 400  # an integer no float holds: float(10**400) raises OverflowError
