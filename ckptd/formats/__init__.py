"""Parsers and checkers for the file formats checkpoints come in (torch zip, pickle, safetensors,
DCP metadata). Pure byte-level code: no store, no stages, and no torch import."""
