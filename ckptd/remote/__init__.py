"""A root's remote keys: the manifest format (`manifest`) and the keys, committed steps and
LATEST pointer under `<url>/<root>/` (`keys`). Reads through the bounded reader only."""
