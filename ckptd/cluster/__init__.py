"""Several daemons on one root or one checkpoint: decisions, no I/O."""
