"""The way back: a step's files rebuilt from its local copy or its remote objects (`files`,
`pipe`), and the checked decoder both use (`decode`). Never touches the daemon's store."""
