"""Shared areas: server directories that clients on the same host read (and write) directly.

A server that offers same-host zero-copy advertises, in its greeting, the absolute
paths of its *areas* (its shared-memory directory, and its spill and data
directories when it has them) and one random *token*, which it writes into a file
named :data:`TOKEN_FILE` at the top of each area.  A client trusts an area only if
that file is there, is a regular file owned by the client's own user, holds exactly
the token, and the area is a real directory of that user that nobody else may write
to (:func:`verify_area`).  A directory of the same name on another host, in another
container or of another server fails the check, and the client uses TCP instead.

Paths that travel in frames are always relative to a verified area and checked
before use (:func:`inside`, :func:`valid_name`); the server checks an item a client
wrote with :func:`check_item_tree` before it adopts it.  This module is torch-free:
the server uses it too.
"""

from __future__ import annotations

import errno
import fcntl
import hmac
import os
import re
import secrets
import signal
import stat

from ..errors import ProtocolError

__all__ = ["TOKEN_FILE", "LOCAL_BUFFER", "new_token", "write_token", "verify_area", "local_socket", "inside", "valid_name",
           "check_item_tree", "not_open_for_writing", "worth_sharing"]

TOKEN_FILE = ".tensorshare-token"
_TOKEN_BYTES = 16
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # an item directory a client names: no dots, no separators
_MAX_PATH = 4096


class AreaError(ProtocolError):
    """A path or directory of a shared area that must not be used (foreign, unsafe or malformed)."""


def new_token() -> str:
    """A fresh random token (hex), one per server run."""
    return secrets.token_hex(_TOKEN_BYTES)


def write_token(root: str, token: str) -> None:
    """Write ``token`` into ``root``'s token file (atomically, readable by the owner only)."""
    tmp = os.path.join(root, f"{TOKEN_FILE}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            data = token.encode("ascii")
            if os.write(fd, data) != len(data):  # (a full file system may take part of it)
                raise OSError(errno.ENOSPC, "the token file was written in part")
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(root, TOKEN_FILE))
    except BaseException:
        os.unlink(tmp)  # a full disk must not keep the half-written file
        raise


def verify_area(root: object, token: object) -> str | None:
    """Why the directory ``root`` is not the area the greeting announced, or None if it is.

    ``root`` must be an absolute, normalised path naming a directory (not a symlink)
    owned by this process's user and writable by nobody else, holding a regular
    token file of that user whose content is exactly ``token``.
    """
    if not isinstance(root, str) or not isinstance(token, str) or not token:
        return "malformed area or token"
    if len(root) > _MAX_PATH or "\x00" in root or not os.path.isabs(root) or os.path.normpath(root) != root:
        return f"area path {root!r:.80} is not absolute and normalised"
    me = os.geteuid()
    try:
        st = os.lstat(root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != me or st.st_mode & 0o022:
            return f"{root} is not a private directory of this user"
        fd = os.open(os.path.join(root, TOKEN_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != me or st.st_size != len(token):
                return f"{root}: its token file is not a regular file of this user with the token"
            data = os.read(fd, len(token) + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{root}: {exc.strerror or exc}"
    if not hmac.compare_digest(data, token.encode("ascii", "replace")):
        return f"{root}: its token does not match (another server, host or container)"
    return None


# Bytes a same-host socket may hold on their way, set on both ends (SO_SNDBUF, which
# bounds a Unix socket's peer too; the system caps it at net.core.wmem_max): as much
# as loopback TCP grows to, not the 208 KiB a Unix socket gets by default.
LOCAL_BUFFER = 4 << 20


def local_socket(offer: object) -> str | None:
    """The Unix socket a greeting's ``shm`` offer names for clients on the server's
    host, if this client may trust it: a socket of this process's user directly in
    one of the offered areas that :func:`verify_area` finds to be the server's (so a
    path named by a server on another host, or by anyone else, is never connected
    to); else None."""
    if not isinstance(offer, dict):
        return None
    path, areas = offer.get("socket"), offer.get("areas")
    if not isinstance(path, str) or not isinstance(areas, list) or "\x00" in path:
        return None
    root = os.path.dirname(path)
    if root not in areas or verify_area(root, offer.get("token")) is not None:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return path if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid() else None


def worth_sharing(nbytes: int, arrays: int, min_bytes: int) -> bool:
    """Whether an item of ``nbytes`` payload bytes in ``arrays`` arrays is worth passing
    through shared memory rather than the socket.

    Each array is a file, which costs a few system calls on both sides, so the bar is
    ``min_bytes`` for up to 4 arrays and rises in proportion beyond (docs/design.md).
    """
    return nbytes >= min_bytes * max(1.0, arrays / 4)


def inside(root: str, relative: object) -> str:
    """``root/relative`` for a relative path that cannot leave ``root``; AreaError otherwise."""
    if not isinstance(relative, str) or not relative or len(relative) > _MAX_PATH or "\x00" in relative:
        raise AreaError(f"bad path {relative!r:.80}")
    parts = relative.split("/")
    if relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise AreaError(f"path {relative!r:.80} leaves its area")
    return os.path.join(root, *parts)


def valid_name(name: object) -> bool:
    """True for a name a client may give an item directory it wrote (one plain path component)."""
    return isinstance(name, str) and bool(_NAME.fullmatch(name))


def check_item_tree(path: str, owner: int) -> list[str]:
    """Check that the item directory ``path`` holds only plain directories and files.

    Refuses (:class:`AreaError`) a ``path`` that is not a directory of ``owner``,
    and any symlink, device, socket or FIFO in it, a file of another user, or a file
    with another hard link (whose other name could change it later).  Returns the
    files' paths.
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise AreaError(f"{path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner:
        raise AreaError(f"{path} is not a directory of the server's user")
    files, stack = [], [path]
    while stack:
        here = stack.pop()
        with os.scandir(here) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
                elif stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == owner:
                    files.append(entry.path)
                else:
                    raise AreaError(f"{entry.path}: only plain files (one link, the server's user) "
                                    "and directories may be adopted")
    return files


_F_SETSIG = 10  # Linux's fcntl command, where Python's fcntl module does not name it


def not_open_for_writing(path: str) -> bool:
    """False if some process has the file open for writing (or mapped writable).

    Asks for a read lease, which Linux grants only while nobody holds the file open
    for writing, and gives it back at once; a writer that opens the file meanwhile
    breaks the lease, and the answer is False too.  True where leases are not available.

    A lease's holder is told of a break by a signal, SIGIO unless the descriptor names
    another, and SIGIO's default action ends the process: a client that opened its
    file for writing at that moment would stop the server.  So the lease asks for
    SIGURG, which a process ignores unless it handles it, and the break is seen by
    looking at the lease before giving it back.
    """
    setlease = getattr(fcntl, "F_SETLEASE", None)
    if setlease is None:  # not Linux
        return True
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETSIG", _F_SETSIG), signal.SIGURG)
        try:
            fcntl.fcntl(fd, setlease, fcntl.F_RDLCK)
        except OSError as exc:
            return exc.errno not in (errno.EAGAIN, errno.EBUSY)
        held = fcntl.fcntl(fd, fcntl.F_GETLEASE)  # F_UNLCK while a writer's open is breaking it
        fcntl.fcntl(fd, setlease, fcntl.F_UNLCK)
        return held == fcntl.F_RDLCK
    finally:
        os.close(fd)
