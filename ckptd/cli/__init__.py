"""The `ckptd` command line: the argument parser (`parser`), running a command (`main`), and
what runs without a daemon or beside it: `verify`, `doctor`, the terminal renderings of the
daemon's documents (`render`), the probes' yes or no (`probe`), the preemption flush and its
wait (`flush`), `ckptd wait` (`wait`), the `--json` documents, errors and terminal progress
(`output`), shell completion scripts (`completion`), and the child process `ckptd.torch.load`
restores in (`restore_child`), and `ckptd memory fetch` (`memory`)."""
