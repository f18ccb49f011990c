"""Opening a user's file without hanging, exhausting memory or misreporting why it failed.

Every file ringtrain reads on a user's say-so (``--config``, a dataset, a
checkpoint, a run's metrics) goes through :func:`open_regular`:

* it opens with ``O_NONBLOCK``, so a FIFO (or a device) named like a data
  file never blocks the open waiting for a writer that will not come;
* it checks with ``fstat`` on the open descriptor (no race with a rename)
  that the file is a regular file, so ``/dev/zero``, a link to it, a FIFO or
  a directory is refused by name instead of read until memory runs out;
* it refuses a file larger than the caller's bound before reading a byte;
* an ``OSError`` becomes a one-line reason that says what happened:
  "permission denied", "symbolic link loop", "no such file".

Pure helpers; nothing here talks to MPI, so they are tested without it.
"""

import errno
import fcntl
import os
import stat
import unicodedata

from ..errors import UsageError

__all__ = ["KiB", "MiB", "GiB", "TiB", "open_regular", "open_regular_fd", "Unreadable", "read_regular", "file_kind",
           "os_reason",
           "one_line", "printable", "human_bytes", "physical_memory"]

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

# Reasons for the errors a user can cause and fix; anything else falls back to strerror.
_REASONS = {
    errno.ENOENT: "no such file",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ELOOP: "symbolic link loop",
    errno.EISDIR: "is a directory",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.ENAMETOOLONG: "file name too long",
    errno.ENXIO: "no such device or address",
    errno.ENODEV: "no such device",
    errno.EIO: "input/output error",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EMFILE: "too many open files",
    errno.ENFILE: "too many open files",
}


def os_reason(exc):
    """A short lower-case reason for an OSError, e.g. ``"permission denied"``."""
    reason = _REASONS.get(exc.errno)
    if reason is None:
        reason = (exc.strerror or str(exc) or type(exc).__name__).strip()
        reason = reason[:1].lower() + reason[1:]
    return reason


def file_kind(mode):
    """What a file of this ``st_mode`` is, in words (``"a FIFO"``), or None for a regular file."""
    for test, name in ((stat.S_ISREG, None), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def human_bytes(n):
    """``3.1 GiB``, ``1 MiB``, ``512 bytes``: binary units, at most one decimal (pure)."""
    n = int(n)
    for unit, scale in (("PiB", 1 << 50), ("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            value = n / scale
            text = f"{value:.0f}" if value == int(value) or value >= 100 else f"{value:.1f}"
            return f"{text} {unit}"
    return f"{n} byte" + ("" if n == 1 else "s")


def one_line(text, limit=300):
    """``text`` as one line of at most ``limit`` characters: whitespace runs become one space, "..." if cut."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


# Control characters (an ESC starts a terminal escape sequence), lone
# surrogates (a non-UTF-8 file name decoded by Python) and the bidirectional
# overrides that make text read differently from what it is.
_UNPRINTABLE = ("Cc", "Cs")
_BIDI = {"\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069"}


def printable(text):
    """``text`` safe to print on a terminal: control characters and the like written as escapes (pure).

    An ESC from a config file or a file name must not reach the terminal,
    where it could rewrite the screen or the window title; ``\\x1b[2J``
    shows what was there instead. Tabs and newlines are escaped too: what
    ringtrain prints is one line.
    """
    text = str(text)
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if unicodedata.category(ch) in _UNPRINTABLE or ch in _BIDI:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def physical_memory():
    """Bytes of physical memory on this machine, or None where the OS will not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def open_regular(path, what=None, max_bytes=None, kind="files", error=UsageError, follow=True):
    """Open a user's file for reading, refusing anything that is not a bounded regular file.

    Args:
        path: the file (symbolic links are followed, as users expect, unless ``follow`` is False).
        what: how the message names it, e.g. ``"--config"`` gives
            ``"--config PATH: ..."``; None gives ``"PATH: ..."``.
        max_bytes: refuse a larger file, before reading any of it.
        kind: the plural the size message uses: "ringtrain reads ``kind`` of
            at most ..." (e.g. ``"config files"``).
        error: the exception class raised (a :class:`UsageError` subclass),
            called with the one-line message.
        follow: False refuses a symbolic link at ``path`` itself (``O_NOFOLLOW``),
            for files in a directory where no link is ever followed.

    Returns:
        A binary file object positioned at the start, in blocking mode.

    Raises:
        ``error``: one line, e.g. ``"--config /tmp/x: is a FIFO, not a
        regular file"`` or ``"x.npz: permission denied"``.
    """
    path = os.fspath(path)
    label = f"{what} {path}" if what else path
    try:
        fd = open_regular_fd(path, max_bytes, follow)
    except Unreadable as exc:
        if exc.oserror is not None and not follow and exc.oserror.errno == errno.ELOOP:
            raise error(f"{label}: is a symbolic link, which is never followed here") from None
        if exc.oserror is not None:
            raise error(f"{label}: {os_reason(exc.oserror)}") from None
        if exc.kind is not None:
            raise error(f"{label}: is {exc.kind}, not a regular file") from None
        raise error(f"{label}: is {human_bytes(exc.size)}; ringtrain reads {kind} of at most "
                    f"{human_bytes(max_bytes)}") from None
    return os.fdopen(fd, "rb")


class Unreadable(Exception):
    """Why :func:`open_regular_fd` refused a file: exactly one of ``oserror``, ``kind`` or ``size`` is set."""

    def __init__(self, oserror=None, kind=None, size=None):
        super().__init__(oserror or kind or size)
        self.oserror, self.kind, self.size = oserror, kind, size


def open_regular_fd(path, max_bytes=None, follow=True):
    """The safe open itself: a blocking read-only descriptor on a bounded regular file.

    Each caller words the refusal its own way (:func:`open_regular`, the
    launcher's hostfile reader); the checks are made here, once.

    ``follow`` False opens with ``O_NOFOLLOW``: a symbolic link at ``path``
    fails with ``ELOOP``.

    Raises:
        Unreadable: the open failed (``oserror``), the file is not a regular
            one (``kind``, in words), or it is over ``max_bytes`` (``size``).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
        # writer forever; O_NOCTTY: a terminal device never becomes ours.
        fd = os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    except OSError as exc:
        raise Unreadable(oserror=exc) from None
    try:
        st = os.fstat(fd)
        named = file_kind(st.st_mode)
        if named is not None:
            raise Unreadable(kind=named)
        if max_bytes is not None and st.st_size > max_bytes:
            raise Unreadable(size=st.st_size)
        # Back to blocking reads: a regular file never blocks, and some
        # readers (zipfile, NumPy) do not expect EAGAIN.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_regular(path, what=None, max_bytes=None, kind="files", error=UsageError):
    """The whole content of a file :func:`open_regular` accepts, as bytes.

    Reads at most ``max_bytes`` even if the file grows while it is read (or,
    like some files under /proc, says it is smaller than it is).
    """
    with open_regular(path, what, max_bytes, kind, error) as fh:
        try:
            data = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
        except OSError as exc:
            label = f"{what} {path}" if what else os.fspath(path)
            raise error(f"{label}: {os_reason(exc)}") from None
    if max_bytes is not None and len(data) > max_bytes:
        label = f"{what} {path}" if what else os.fspath(path)
        raise error(f"{label}: is more than {human_bytes(max_bytes)}; ringtrain reads {kind} of at most "
                    f"{human_bytes(max_bytes)}")
    return data
