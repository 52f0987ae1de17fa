"""The way back to files: `ckptd restore` rebuilds a step's files from its local copy or its
remote objects (`files`, reading through `ckptd.fetch`), and the restore child's one JSON line
(`answer`). Never touches the daemon's store."""
