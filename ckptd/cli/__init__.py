"""The `ckptd` command line: the argument parser (`parser`), running a command (`main`), and
what runs without a daemon or beside it: `verify`, `doctor`, the terminal renderings of the
daemon's documents (`render`), the probes' yes or no (`probe`), the preemption flush and its
wait (`flush`), and the child process `ckptd.torch.load` restores in (`restore_child`)."""
