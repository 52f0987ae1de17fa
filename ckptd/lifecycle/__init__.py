"""The checkpoint lifecycle: statuses, events, effects and the pure transition table
(`table`, which also decides when a stalled save gives up); a root's lifecycle `Policy` read
from its config (`policy`); the domain answers decided once, latest, best, newest, committed
and whether a copy is still needed (`answers`, pure); and the "something changed" signal
long-polls wait on (`changes`). What carries out a transition's effects is a service
(`ckptd.service.effects`)."""
