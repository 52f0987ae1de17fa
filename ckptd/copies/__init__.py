"""The local copy store: compressed copies of steps under `<root>/.ckptd/objects/step-<N>/`,
their manifests, and the checks before a copy may stand in for the originals (`store`)."""
