"""The remote layout of a root: the manifest format (`manifest`) and the keys, committed steps
and LATEST pointer under `<url>/<root>/` (`layout`). Reads through the bounded reader only."""
