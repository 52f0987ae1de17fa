"""Pure policy decisions (retention): plain data in, decisions with reasons out.

Nothing here does I/O, reads the clock or touches the store; imports only `ckptd.model`.
"""
