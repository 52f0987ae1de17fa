"""Retention: `planner` (pure: keep / compress / delete, with reasons) -> `executor` (the safety
nets, crash-safe deletes; never the store) -> `scheduler` (the one thread that runs retention).

Re-exports nothing: lower layers import `planner` alone without pulling in the scheduler's stack.
"""
