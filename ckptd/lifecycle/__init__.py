"""The checkpoint lifecycle: statuses, events and the pure transition table (`table`), and the
one hook that carries out a committed transition's consequences (`effects`)."""
