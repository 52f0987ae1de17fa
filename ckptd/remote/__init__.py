"""A root's remote keys: the manifest format (`manifest`) and the keys, committed steps and
LATEST pointer under `<url>/<root>/` (`keys`). The documents it reads (manifests, LATEST)
go through the bounded reader (`ckptd.inputs`); reading a step's objects back is
`ckptd.fetch`'s."""
