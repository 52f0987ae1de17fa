"""A root's peers, found in the bucket its nodes share: each daemon writes one small entry,
`<root>/_peers/<node>.json` (where to dial it, when it last said so, which peers hold its
state), and reads everyone's; and which peers a node sends its state to.

Owns the entry's format, its strict bounded parse and the choice of peers (a pure function).
Writes only the calling node's own entry; never deletes an object, never reads the clock (the
caller stamps `updated`), never dials a peer.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

from ckptd import inputs
from ckptd.backends.base import Backend
from ckptd.errors import BadInput, BadValue, CorruptData, Malformed, ObjectNotFound
from ckptd.log import get_logger
from ckptd.remote.keys import peer_key, peers_prefix

MAX_ENTRY = 64 << 10  # the most bytes one entry may hold
MAX_HELD_BY = 256
MAX_PEERS = 1024
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*", re.ASCII)
_PORT = re.compile(r"[1-9][0-9]{0,4}", re.ASCII)
_KEYS = {"node", "address", "updated", "held_by"}


@dataclass(frozen=True)
class PeerEntry:
    """A node of a root: dial `address` ("host:port") to reach its daemon; written at
    `updated` (seconds since the epoch, the writer's clock); `held_by` the (node, step) pairs
    of the peers that hold a copy of its state."""

    node: str
    address: str
    updated: float
    held_by: tuple[tuple[str, int], ...] = ()


def check_node(node: object, what: str = "node") -> str:
    """`node` if it is a node id: 1 to 128 of [A-Za-z0-9._-], starting with a letter or digit
    (every `daemon.node` is one); else BadValue."""
    if not isinstance(node, str) or not _NAME.fullmatch(node):
        raise BadValue(f"{what} {_show(node)} is not 1 to 128 of [A-Za-z0-9._-] starting with"
                       " a letter or digit")
    return node


def check_address(address: object) -> tuple[str, int]:
    """(host, port) of a dialable "host:port": a host name, an IPv4 address or a bracketed
    IPv6 one, not the unspecified address; port 1 to 65535. BadValue otherwise."""
    if not isinstance(address, str) or len(address) > 300 or ":" not in address:
        raise BadValue(f"address {_show(address)} is not host:port")
    host, _, port = address.rpartition(":")
    if not _PORT.fullmatch(port) or int(port) > 65535:
        raise BadValue(f"address {_show(address)}: port must be 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = _ip(host[1:-1], address)
        if ip is not None and ip.version != 6:
            raise BadValue(f"address {_show(address)}: only an IPv6 address goes in brackets")
    elif _HOST.fullmatch(host) and len(host) <= 253:
        ip = _ip(host, address) if host.replace(".", "").isdigit() else None
    else:
        raise BadValue(f"address {_show(address)}: {_show(host)} is not a host name or address")
    if ip is not None and ip.is_unspecified:
        raise BadValue(f"address {_show(address)}: the unspecified address cannot be dialled")
    return host.strip("[]"), int(port)


def _ip(text: str, address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise BadValue(f"address {_show(address)}: {_show(text)} is not an IP address") from None


def entry_json(entry: PeerEntry) -> bytes:
    """The entry as stored; BadValue for an entry `parse_entry` would refuse."""
    doc = {"node": entry.node, "address": entry.address, "updated": entry.updated,
           "held_by": [{"node": n, "step": s} for n, s in entry.held_by]}
    try:
        data = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode() + b"\n"
    except (TypeError, ValueError) as exc:
        raise BadValue(f"peer entry of {_show(entry.node)} is not JSON: {exc}") from None
    try:
        parse_entry(data, f"{entry.node}.json")
    except CorruptData as exc:
        raise BadValue(str(exc)) from None
    return data


def parse_entry(data: bytes, key: str) -> PeerEntry:
    """The entry stored under `key` (whose last part must be `<node>.json` of the entry's
    node), strictly checked; Malformed (a CorruptData) otherwise."""
    if len(data) > MAX_ENTRY:
        raise Malformed(f"{key}: {len(data)} bytes, over {MAX_ENTRY}")
    try:
        doc = inputs.loads(data, key)
        if not isinstance(doc, dict) or set(doc) != _KEYS:
            raise Malformed(f"{key}: not an object with exactly {sorted(_KEYS)}")
        node = check_node(doc["node"])
        if f"{node}.json" != key.rpartition("/")[2]:
            raise Malformed(f"{key}: the entry of node {node!r} under another node's key")
        check_address(doc["address"])
        updated = inputs.check_float(doc["updated"], f"{key}: updated", 0.0, 2.0**40)
        held = _held_by(doc["held_by"], key)
    except (BadInput, BadValue) as exc:
        raise Malformed(f"{key}: {exc}") from None
    return PeerEntry(node, doc["address"], updated, held)


def _held_by(listing: Any, key: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(listing, list) or len(listing) > MAX_HELD_BY:
        raise Malformed(f"{key}: held_by must be a list of at most {MAX_HELD_BY}")
    out: list[tuple[str, int]] = []
    for item in listing:
        if not isinstance(item, dict) or set(item) != {"node", "step"}:
            raise Malformed(f"{key}: each of held_by must be an object with node and step")
        out.append((check_node(item["node"], "held_by node"),
                    inputs.check_int(item["step"], f"{key}: held_by step")))
    return tuple(out)


def publish(backend: Backend, root: str, entry: PeerEntry) -> None:
    """Write (overwrite) this node's entry; BadValue for a bad entry, storage errors as the
    backend raises them."""
    backend.put(peer_key(root, check_node(entry.node)), entry_json(entry))


def peers(backend: Backend, root: str, limit: int = MAX_PEERS) -> list[PeerEntry]:
    """Every node's entry of `root`, by node (at most `limit` entries listed and read, each
    at most MAX_ENTRY bytes). An entry that is malformed, oversized, under a key that is not
    `<node>.json`, or of another node than its key says is skipped with a warning
    (`peer_entry_skipped`); one deleted meanwhile is skipped quietly. Other storage errors
    propagate."""
    prefix = peers_prefix(root)
    listed = islice(backend.list(prefix), limit + 1)
    keys = sorted(meta.key for meta in listed)
    log = get_logger()
    for key in keys[limit:]:
        log.warning("peer_entry_skipped", root=root, key=key,
                    error=f"over the {limit} entries read under {prefix}")
    keys = keys[:limit]
    out: list[PeerEntry] = []
    for key in keys:
        try:
            if not key.startswith(prefix) or not key.endswith(".json") or (
                    "/" in key[len(prefix):]):
                raise Malformed(f"{key}: not a peer entry's key")
            out.append(parse_entry(backend.get_bytes(key, MAX_ENTRY), key))
        except ObjectNotFound:
            continue
        except CorruptData as exc:
            log.warning("peer_entry_skipped", root=root, key=key, error=str(exc))
    return out


def choose(nodes: Iterable[str], me: str, replicas: int) -> list[str]:
    """The `replicas` nodes that follow `me` in sorted order, wrapping around; never `me`,
    each once; fewer when there are fewer other nodes."""
    others = sorted(set(nodes) - {me})
    after = [n for n in others if n > me] + [n for n in others if n < me]
    return after[:max(replicas, 0)]


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
