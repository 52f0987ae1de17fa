"""The way back: a step's files rebuilt from its local copy or its remote objects (`files`),
which step and from where (`source`), one remote object downloaded and decoded as a pipeline
(`pipe`), and the one JSON line a restore child answers with (`answer`). The checked decoder
they use is `ckptd.copies.decode`. Never touches the daemon's store."""
