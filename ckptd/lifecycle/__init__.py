"""The checkpoint lifecycle as data: statuses, events, effects and the pure transition table
(`table`). What carries out a transition's effects is a service (`ckptd.service.effects`)."""
