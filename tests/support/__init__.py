"""Shared test support: one wait helper, config rendering, and the two ways to run a daemon
(a `ckptd run` subprocess, or a Daemon inside the test process). Holds no tests."""
