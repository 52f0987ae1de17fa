"""The `ckptd` command line (`main`) and the offline commands it runs without a daemon:
`verify`, `doctor`, and the terminal renderings of the daemon's documents (`render`)."""
