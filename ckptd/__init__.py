"""ckptd: a checkpoint daemon for ML training.

Finds complete checkpoints, validates them, compresses, uploads and prunes them, and answers
"which step is the latest valid one" over a local Unix socket.
"""

# The one place the version is written: pyproject.toml reads it (`[tool.setuptools.dynamic]`).
__version__ = "0.1.0"
# `open` is resolved on first use (`__getattr__`).
__all__ = ["__version__", "build_info", "needs_torch", "open", "torch_version"]

# PyTorch is an optional extra: the daemon, the command line and the client run without it.
TORCH_EXTRA = "pip install 'ckptd[torch]'"


def needs_torch(feature: str) -> str:
    """The one line a feature that needs PyTorch says when it is not installed."""
    return f"{feature} needs PyTorch: {TORCH_EXTRA}"


def torch_version() -> str | None:
    """The installed PyTorch's version, found without importing it (an import takes seconds);
    None when `import torch` would find nothing."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:  # none, or a stray `torch/` directory on the path
        return None
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # importable, but not installed by pip
        return "unknown version"


def build_info() -> str:
    """`ckptd --version`: ckptd's version and what it runs on, for a bug report."""
    import platform
    import sys

    torch = torch_version()
    return "\n".join([
        f"ckptd {__version__}",
        f"python {platform.python_version()} ({platform.python_implementation()},"
        f" {sys.executable})",
        f"platform {platform.platform()}",
        f"torch {torch}" if torch else f"torch not installed: deep_validate, ckptd.torch,"
                                        f" ckptd.dcp and ckptd demo need it ({TORCH_EXTRA})",
    ])



def __getattr__(name: str) -> object:
    """`ckptd.open` (docs/TORCH.md, "Loading from the remote"): one original file of a
    committed remote step as a read-only, seekable binary file. Resolved on first use, so
    `import ckptd` stays light and the package root imports none of its modules."""
    if name == "open":
        import importlib

        return importlib.import_module("ckptd.fetch.openfile").open_remote
    raise AttributeError(f"module 'ckptd' has no attribute {name!r}")
