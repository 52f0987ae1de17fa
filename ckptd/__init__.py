"""ckptd: a checkpoint daemon for ML training.

Finds complete checkpoints, validates them, compresses, uploads and prunes them, and answers
"which step is the latest valid one" over a local Unix socket.
"""

__version__ = "0.1.0"
__all__ = ["__version__", "open"]  # `open` is resolved on first use (`__getattr__`)



def __getattr__(name: str) -> object:
    """`ckptd.open` (docs/TORCH.md, "Loading from the remote"): one original file of a
    committed remote step as a read-only, seekable binary file. Resolved on first use, so
    `import ckptd` stays light and the package root imports none of its modules."""
    if name == "open":
        import importlib

        return importlib.import_module("ckptd.remote.openfile").open_remote
    raise AttributeError(f"module 'ckptd' has no attribute {name!r}")
