"""The checkpoint lifecycle: statuses, events, effects and the pure transition table
(`table`); the domain answers decided once, latest, best and committed (`answers`, pure); and
the "something changed" signal long-polls wait on (`changes`). What carries out a
transition's effects is a service (`ckptd.service.effects`)."""
