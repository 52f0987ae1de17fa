"""Stored copies: the local copy store under `<root>/.ckptd/objects/step-<N>/` with its manifests
and the checks before a copy may stand in for the originals (`store`), and the checked decoder
of a stored object, local or remote (`decode`)."""
