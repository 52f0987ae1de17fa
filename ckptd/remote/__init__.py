"""The remote layout of a root and its readers: the manifest format (`manifest`); the keys,
committed steps and LATEST pointer under `<url>/<root>/` (`layout`); a committed step opened for
reading (`step`), one stored file read by ranges (`objects`) or as a seekable file (`openfile`);
a reader's hold on a step (`holds`). The documents it reads (manifests, LATEST) go through the
bounded reader (`ckptd.inputs`)."""
