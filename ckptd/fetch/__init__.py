"""Reading a stored step back, shared by `ckptd restore` and the loaders: which step and from
where (`source`), a reader's hold (`holds`), a committed remote step opened (`step`), ranged,
block-checked reads of one stored file (`objects`, which fetches the spans `spans` schedules),
one file as a file object (`openfile`), one remote object streamed to a file (`pipe`). Never
imports the daemon's store, services or API."""
