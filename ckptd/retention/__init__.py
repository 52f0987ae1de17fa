"""Retention: `planner` (pure: keep / compress / delete, with reasons; the keep rules it asks
are registered in `rules`) -> `executor` (the safety `nets`, crash-safe deletes through the
`trash`, each delete's `outcomes` and their events; never the store) -> `run` (one root's run:
`views` of the store's rows, `inplace` compress_older, `report`). The thread that schedules the
runs is a service (`ckptd.service.retention`). Re-exports nothing: lower layers import
`planner` alone without pulling in the executor's stack.
"""
