"""Shared test support: one wait helper, config rendering, the two ways to run a daemon (a
`ckptd run` subprocess, or a Daemon inside the test process), and the helpers that two or more
test files use (no test file imports another). Holds no tests."""

from support.harness import Harness, raw
from support.wait import wait_scans, wait_until

__all__ = ["Harness", "raw", "wait_scans", "wait_until"]
