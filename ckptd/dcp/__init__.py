"""`ckptd.dcp.StorageReader`: a torch.distributed.checkpoint StorageReader that loads a committed
step straight from the root's remote, no staging disk: each rank fetches only the blocks of the
byte ranges its read items need, checks every block as it is decoded (and every file it reads
whole against its manifest hash), and routes each tensor's bytes into the destination tensor.
The package: reader (the StorageReader), route (a file's bytes to its slices), slices (one
tensor's archive parsed as it streams), tensorpkl (a slice's pickles), meta (`.metadata`).
Decides nothing about the plan (DCP's planner does) and writes nothing but the destinations.
"""

from ckptd.dcp.reader import StorageReader

__all__ = ["StorageReader"]
