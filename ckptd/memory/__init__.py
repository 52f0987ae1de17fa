"""Restoring from memory (docs/MEMORY.md): the state a daemon keeps for a restarted trainer and
the copies it holds for its peers.

Owns the arenas this node's daemon keeps after an async save (`own`), the peers' protocol over
TCP (`proof`: the shared-secret proof every request carries; `wire`: a replica's bytes;
`peerserver` and `peerclient`; `httpbody`: a request body's framing as it arrives), the
replicas held for other nodes (`replicas`), where a root's peers are found (`directory`, in
the bucket they share) and the replication itself (`replicate`). Never deletes a checkpoint
file and never reads the store.
"""
