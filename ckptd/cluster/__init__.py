"""Several daemons on one root or one checkpoint, decided: the root lease rule (`lease`), the
multi-node commit (`commit`) and which node coordinates a root (`coordinator`). Decisions on
what the caller read, and `now` passed in: no I/O, no clock."""
