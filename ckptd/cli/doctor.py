"""`ckptd doctor`: what a new setup gets wrong, each problem with its fix. Reads the config and
looks at the machine as the daemon would; changes nothing but a few probe files it removes
(one in the state dir, one in each root's `.ckptd/`, one object on each remote).

Owns no state: every check is a function returning Checks; `run` collects them.
"""

from __future__ import annotations

import grp
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ckptd import inputs
from ckptd.backends import make_backend
from ckptd.client import Client
from ckptd.cluster.lease import LEASE_FILE, Holder
from ckptd.codec import kernels
from ckptd.config import Config, RootConfig
from ckptd.errors import CkptdError, ObjectExists
from ckptd.fileio import open_beneath
from ckptd.lifecycle import answers
from ckptd.model import CKPTD_DIR
from ckptd.units import format_size
from ckptd.watch.scanner import RootScanner

OK, WARN, PROBLEM, SKIP = "ok", "warning", "problem", "skipped"
REMOTE_TIMEOUT_S = 10.0  # each probe request: a remote that accepts but never answers is said
UNIT_PATHS = tuple(Path(d) / "ckptd.service" for d in (
    "/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system"))
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Check:
    what: str
    status: str
    message: str
    fix: str = ""


def run(config: Config, config_path: Path | None, unit: Path | None = None,
        remote: bool = True) -> list[Check]:
    """Every check, in the order a new user meets them."""
    out = [Check("config", OK, f"{config_path or 'the embedded default'} parses")]
    out += state_dir(config)
    out += socket_checks(config)
    if not config.roots and not config.globs:
        out.append(Check("roots", WARN, "the config has no [[roots]]: the daemon watches nothing",
                         "add a [[roots]] table with the name and path of a checkpoint"
                         " directory (see config.example.toml)"))
    for root in config.roots:
        out += root_checks(root, config.daemon.lease_timeout)
        if remote and root.upload.enabled:
            out.append(remote_check(root))
    out += unit_checks(config, unit)
    out.append(codec_check())
    return out


def codec_check() -> Check:
    """Which codec kernels run: the compiled ones, or the slower numpy path and why."""
    try:
        said = kernels.describe()
    except (ImportError, CkptdError) as exc:  # CKPTD_CODEC_KERNELS=c without them, or a typo
        return Check("codec kernels", PROBLEM, f"{kernels.ENV}: {exc}",
                     f"unset {kernels.ENV} (the compiled kernels where built, else numpy),"
                     " or set it to auto, c or numpy")
    if said.startswith("numpy") and not said.endswith(f"{kernels.ENV}=numpy)"):
        return Check("codec kernels", WARN, said,
                     "reinstall ckptd where a C compiler and Python's headers are present:"
                     " byte-grouped decoding runs about 2.3x slower on the numpy path"
                     " (PERFORMANCE.md, \"The plane kernels\")")
    return Check("codec kernels", OK, said)


# -- the daemon's own directories --------------------------------------------------------------


def _probe_dir(path: Path) -> str | None:
    """None when a file can be created and removed in `path` (or, when it does not exist yet,
    in its nearest existing parent); else why not."""
    target = path
    while not target.exists():
        if target.parent == target:
            return f"no existing parent of {path}"
        target = target.parent
    if not target.is_dir():
        return f"{target} is not a directory"
    probe = target / f".ckptd-doctor-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write in {target}: {exc.strerror}"
    return None


def state_dir(config: Config) -> list[Check]:
    d = config.daemon.state_dir
    why = _probe_dir(d)
    if why is not None:
        return [Check("state dir", PROBLEM, f"{d}: {why}",
                      f"create it writable by the daemon's user (`install -d -o ckptd -g ckptd"
                      f" -m 0750 {d}`), or set daemon.state_dir")]
    return [Check("state dir", OK, f"{d}: writable, {format_size(_free(d))} free")]


def socket_checks(config: Config) -> list[Check]:
    sock = config.daemon.socket
    out = []
    why = _probe_dir(sock.parent)
    out.append(Check("socket dir", PROBLEM, f"{sock.parent}: {why}",
                     "create it writable by the daemon (systemd's RuntimeDirectory=ckptd does),"
                     " or set daemon.socket") if why else
               Check("socket dir", OK, f"{sock.parent}: writable"))
    group = config.daemon.socket_group
    if group:
        try:
            grp.getgrnam(group)
            out.append(Check("socket group", OK, f"group {group!r} exists"))
        except KeyError:
            out.append(Check("socket group", PROBLEM, f"group {group!r} does not exist",
                             f"`groupadd --system {group}` and add the training users to it"))
    health = Client(sock, timeout=3.0).health() if sock.exists() else None
    out.append(Check("daemon", OK, f"answers on {sock} ({health['status']})") if health else
               Check("daemon", WARN, f"nothing answers on {sock}",
                     "start it (`systemctl start ckptd`, or `ckptd run --config ...`)"))
    return out + (_not_acting(health) if health else [])


def _not_acting(health: dict[str, Any]) -> list[Check]:
    """The roots the running daemon says it cannot act on, with its reason."""
    return [Check(f"root {r.get('root')}", PROBLEM,
                  f"the daemon does not act on it: {r.get('problem')}",
                  "fix what the reason names (see OPERATIONS.md, \"status says NOT ACTING\");"
                  " the daemon looks again every few seconds and acts once it can")
            for r in health.get("roots_not_acting") or [] if isinstance(r, dict)]


# -- roots -------------------------------------------------------------------------------------


def root_checks(root: RootConfig, lease_timeout: float) -> list[Check]:
    what = f"root {root.name}"
    p = root.path
    if not p.is_dir():
        return [Check(what, PROBLEM, f"{p} does not exist or is not a directory",
                      f"create it, or correct the path of root {root.name!r}")]
    try:
        os.listdir(p)
    except OSError as exc:
        return [Check(what, PROBLEM, f"cannot list {p}: {exc.strerror}",
                      "give the daemon's user read access (group ckptd, or an ACL:"
                      f" `setfacl -R -m g:ckptd:rwX -m d:g:ckptd:rwX {p}`)")]
    out = [_root_writable(root), *_lease_holder(root, lease_timeout)]
    out.append(_room(root))
    return out


def _root_writable(root: RootConfig) -> Check:
    what = f"root {root.name}"
    own = root.path / CKPTD_DIR
    if own.is_symlink():
        return Check(what, PROBLEM, f"{own} is a symlink: ckptd never follows one out of a root",
                     f"remove the link (`rm {own}`); ckptd recreates the directory")
    why = _probe_dir(own)
    if why is not None:
        return Check(what, PROBLEM, f"{why}: ckptd cannot lease, prune or publish latest.json",
                     "make the root writable by the daemon's user (and list it in the unit's"
                     " ReadWritePaths=)")
    return Check(what, OK, f"{root.path}: readable and writable")


def _lease_holder(root: RootConfig, lease_timeout: float) -> list[Check]:
    path = root.path / CKPTD_DIR / LEASE_FILE
    try:  # never through a symlink, never blocking on a FIFO
        fd = open_beneath(root.path, f"{CKPTD_DIR}/{LEASE_FILE}")
    except FileNotFoundError:
        return []
    except (OSError, CkptdError) as exc:  # a link, a FIFO, a directory
        return [Check(f"root {root.name} lease", WARN, f"{path} cannot be read ({exc})",
                      f"remove it if it is not a regular file (a daemon replaces a damaged"
                      f" lease.json, but not a directory): `ls -la {path.parent}`")]
    try:
        data, age = inputs.read_fd(fd, inputs.LEASE, str(path)), time.time() - os.fstat(fd).st_mtime
        h = Holder.from_json(inputs.loads(data, str(path)))
    except OSError as exc:
        return [Check(f"root {root.name} lease", WARN, f"{path} cannot be read ({exc})", "")]
    except (ValueError, CkptdError) as exc:
        return [Check(f"root {root.name} lease", WARN, f"{path} is damaged ({exc})",
                      "nothing to do: a daemon replaces it once the lease goes stale")]
    finally:
        os.close(fd)
    state = ("released" if h.released else f"renewed {age:.0f}s ago"
             + (" (stale)" if age > lease_timeout else ""))
    return [Check(f"root {root.name} lease", OK,
                  f"acted on by node {h.node} (pid {h.pid} on {h.host}), {state}")]


def _room(root: RootConfig) -> Check:
    """Free space against the newest checkpoint's size: the next save needs about as much."""
    what = f"root {root.name} space"
    scanner = RootScanner(root.name, root.path, root.layout, root.options)
    snap, found = scanner.scan(time.time())
    free = _free(root.path)
    if not found:
        return Check(what, OK, f"{format_size(free)} free; no checkpoint yet to size against")
    top = answers.newest(c.step for c, _ in found)
    newest = next(c for c, _ in found if c.step == top)
    size = sum(snap.files[f].size for f in newest.files if f in snap.files)
    total = shutil.disk_usage(root.path).total
    keep = root.retention.local.min_free.required(total)
    if free < size:
        return Check(what, PROBLEM, f"{format_size(free)} free, but step {newest.step} takes"
                     f" {format_size(size)}: the next save may not fit",
                     "free space, or lower keep_last / set keep_within so retention frees more")
    if free - size < keep:
        return Check(what, WARN, f"{format_size(free)} free; after a save of"
                     f" {format_size(size)} less than min_free ({format_size(keep)}) is left:"
                     " retention will delete the oldest deletable checkpoints", "")
    return Check(what, OK, f"{format_size(free)} free, newest checkpoint (step {newest.step})"
                 f" {format_size(size)}")


def _free(path: Path) -> int:
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


# -- the remote ----------------------------------------------------------------------------------


def remote_check(root: RootConfig) -> Check:
    """Write, re-write create-only (must be refused), read back and delete one probe object."""
    up = root.upload
    what = f"root {root.name} remote"
    key = f".ckptd-doctor/{secrets.token_hex(8)}"
    body = b"ckptd doctor probe\n"
    try:
        backend = make_backend(
            up.url, endpoint=up.endpoint, region=up.region, access_key_id=up.access_key_id,
            secret_access_key=up.secret_access_key.get_secret_value(), part_size=up.part_size,
            concurrency=1, connect_timeout_s=REMOTE_TIMEOUT_S, read_timeout_s=REMOTE_TIMEOUT_S,
            request_timeout_s=REMOTE_TIMEOUT_S, request_retries=0)
        backend.put(key, body, len(body), create_only=True)
    except (CkptdError, OSError, ValueError) as exc:
        return Check(what, PROBLEM, f"cannot write to {up.url}: {exc}",
                     "check upload.url, endpoint, region and the credentials (upload keys,"
                     " else AWS_* / GOOGLE_* / AZURE_* variables)")
    try:
        try:
            backend.put(key, b"overwritten\n", 12, create_only=True)
            honoured = False
        except ObjectExists:
            honoured = True
        back = backend.get_bytes(key, 1 << 20)  # the probe is a few bytes
    except (CkptdError, OSError) as exc:
        return Check(what, PROBLEM, f"wrote a probe to {up.url} but could not read it: {exc}",
                     "the credentials need read (GetObject) and list permission too")
    finally:
        try:
            backend.delete(key)
        except (CkptdError, OSError):
            pass
    if not honoured or back != body:
        return Check(what, PROBLEM, f"{up.url} does not honour create-only writes (an"
                     " If-None-Match put overwrote an object)",
                     "use a store that supports conditional writes (AWS S3, GCS, Azure,"
                     " MinIO, SeaweedFS); ckptd's commit of a step relies on them")
    return Check(what, OK, f"{up.url}: write, create-only, read and delete work")


# -- the systemd unit ----------------------------------------------------------------------------


def unit_settings(unit: Path) -> dict[str, list[str]]:
    """The [Service] settings of `unit` and its drop-ins (`<unit>.d/*.conf`, in name order);
    an empty assignment resets a list, as systemd does."""
    settings: dict[str, list[str]] = {}
    drop = unit.parent / f"{unit.name}.d"
    files = [unit, *sorted(drop.glob("*.conf"))] if drop.is_dir() else [unit]
    for f in files:
        section = ""
        for line in f.read_text(errors="replace").splitlines():
            line = line.strip()
            if line.startswith("[") and line.endswith("]"):
                section = line
            elif section == "[Service]" and "=" in line and not line.startswith(("#", ";")):
                key, _, value = line.partition("=")
                if not value.strip():
                    settings[key.strip()] = []
                else:
                    settings.setdefault(key.strip(), []).extend(value.split())
    return settings


def _under(path: Path, prefixes: list[str]) -> bool:
    p = PurePosixPath(os.path.abspath(path))
    return any(p == PurePosixPath(x) or PurePosixPath(x) in p.parents for x in prefixes)


def unit_checks(config: Config, unit: Path | None) -> list[Check]:
    found = unit if unit is not None else next((u for u in UNIT_PATHS if u.is_file()), None)
    if found is None or not found.is_file():
        return [Check("systemd unit", SKIP, "no ckptd.service installed")]
    try:
        s = unit_settings(found)
    except OSError as exc:
        return [Check("systemd unit", WARN, f"cannot read {found} or its drop-ins:"
                      f" {exc.strerror or exc} ({exc.filename})",
                      "run doctor as a user that can read the unit, or fix its files")]
    last = {k: (v[-1] if v else "") for k, v in s.items()}
    writable = [w.lstrip("-+:") for w in s.get("ReadWritePaths", [])]
    writable += [str(config.daemon.state_dir)] if last.get("StateDirectory") else []
    out = []
    for root in config.roots:
        what = f"unit sandbox, root {root.name}"
        if last.get("PrivateTmp") in ("yes", "true", "1") and _under(root.path, ["/tmp",
                                                                                "/var/tmp"]):
            out.append(Check(what, PROBLEM, f"{root.path} is under /tmp, which the unit's"
                             " PrivateTmp=yes replaces with its own: the daemon does not see"
                             " it", "put the root elsewhere, or `PrivateTmp=no` in a"
                             " drop-in"))
        elif last.get("ProtectHome") in ("yes", "true", "tmpfs") and _under(
                root.path, ["/home", "/root", "/run/user"]):
            out.append(Check(what, PROBLEM, f"{root.path} is hidden by ProtectHome="
                             f"{last['ProtectHome']}", "put the root elsewhere, or"
                             " `ProtectHome=read-only` plus ReadWritePaths= in a drop-in"))
        elif last.get("ProtectSystem") == "strict" and not _under(root.path, writable):
            out.append(Check(what, PROBLEM, f"{root.path} is read-only for the service"
                             " (ProtectSystem=strict, not in ReadWritePaths=)",
                             f"a drop-in: `systemctl edit ckptd`, then [Service]"
                             f" ReadWritePaths=-{root.path}"))
        else:
            out.append(Check(what, OK, f"{root.path} is visible and writable to the service"))
    return out


# -- output ----------------------------------------------------------------------------------------


def render(checks: list[Check]) -> Iterator[str]:
    for c in checks:
        yield f"{c.status.upper():<9}{c.what}: {c.message}"
        if c.fix and c.status in (PROBLEM, WARN):
            yield f"{'':<9}fix: {c.fix}"
    problems = sum(c.status == PROBLEM for c in checks)
    warnings = sum(c.status == WARN for c in checks)
    yield f"{problems} problem(s), {warnings} warning(s)"


def as_json(checks: list[Check]) -> dict[str, Any]:
    return {"ok": not any(c.status == PROBLEM for c in checks),
            "codec_kernels": next((c.message for c in checks if c.what == "codec kernels"),
                                  None),
            "checks": [asdict(c) for c in checks]}
