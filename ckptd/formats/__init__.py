"""Parsers and checkers for the file formats checkpoints come in: torch zip (`zipcheck`, `zipdir`,
`zipcrc`), pickle (`picklescan`, `torchpickle`, `torchhead`), safetensors (`safetensors`), DCP
metadata (`dcpmeta`). Pure byte-level code: no store, no stages, and no torch import."""
