"""ckptd: a checkpoint daemon for ML training.

Finds complete checkpoints, validates them, compresses, uploads and prunes them, and answers
"which step is the latest valid one" over a local Unix socket.
"""

__version__ = "0.1.0"
