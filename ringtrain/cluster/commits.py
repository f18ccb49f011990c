"""The elastic directory: what the launcher and its job share, and why rank 0 may trust what it reads back.

An elastic launch (:mod:`ringtrain.cluster.elastic`) and its job meet in
one directory, ``$RINGTRAIN_ELASTIC_DIR``:

* ``commits/``: rank 0's commits, one checkpoint file of
  :mod:`ringtrain.io.checkpoint` each (whole or absent, SHA-256 over every
  byte), the newest two kept;
* ``commit.key``: 32 random bytes, mode 0600, made once by the first launch
  (or the first commit) that uses the directory;
* ``hosts.json``: the launcher's host notices; ``listening.json``: the job
  saying it reads them.

The trust model. A commit holds a pickle (the state's Python objects), and
unpickling runs whatever code it names: a commit is as trusted as the
script. So a commit is restored only when it was written by a launch of
this directory: each carries an HMAC-SHA256 of its arrays and fields under
the key, checked with :func:`hmac.compare_digest` before anything is
unpickled. A SHA-256 alone proves nothing (anyone can compute one). The
key is only as secret as the directory, so the directory must be the
user's: owned by them and writable by nobody else (as ssh refuses a key
file others can write; a group that is theirs alone is them), under directories that are root's or the user's
and that nobody else may write unless sticky (so nobody can swap it), and
no symbolic link is followed under it. A
commit that fails is skipped with one line and never unpickled.

Framework-neutral (no torch): :class:`CommitStore` pickles a snapshot
whole; a framework's store (:mod:`ringtrain.torch.elastic.commits`) turns
its tensors into arrays by overriding :meth:`CommitStore.encode` and
:meth:`CommitStore.decode`. Only rank 0 calls the store; nothing here talks
to MPI.
"""

import errno
import hmac
import json
import os
import pickle
import secrets
import stat
import warnings

import numpy as np

from ..environment import env_int
from ..errors import UsageError
from ..io.checkpoint import CheckpointError, CheckpointTooNew, hash_arrays, list_checkpoints, read_checkpoint, \
    save_checkpoint
from ..io.rundir import create_new, write_json_atomic
from ..io.safeio import file_kind, os_reason

__all__ = ["ENV_DIR", "ENV_JOB", "ENV_GENERATION", "COMMITS", "KEY_FILE", "FORMAT", "elastic_env",
           "under_elastic_launch", "elastic_start", "write_notice", "read_notice", "write_listening", "is_listening",
           "directory_problem", "ancestor_problem", "owners_own_group", "is_owners_own_group",
           "check_private_directory", "check_ancestors", "make_private_directory", "make_key", "read_key",
           "commit_mac", "CommitStore"]

ENV_DIR = "RINGTRAIN_ELASTIC_DIR"
ENV_JOB = "RINGTRAIN_ELASTIC_JOB"
ENV_GENERATION = "RINGTRAIN_ELASTIC_GENERATION"
COMMITS = "commits"
KEY_FILE = "commit.key"
FORMAT = 1
_NOTICE = "hosts.json"
_LISTENING = "listening.json"
_KEY_BYTES = 32
# A notice is a few lines; anything bigger was not written by the launcher.
_MAX_JSON = 64 * 1024
_STATE = "state"
_KEEP = 2


# --- the contract with the job ------------------------------------------------

def elastic_env(directory, job, generation):
    """The variables that tell a job where its commits go and which start this is (pure)."""
    return {ENV_DIR: directory, ENV_JOB: str(job), ENV_GENERATION: str(generation)}


def under_elastic_launch(env):
    """True when ``env`` is a job's under a launcher that restarts it, possibly at another size (pure)."""
    return elastic_start(env) is not None


def elastic_start(env):
    """``(job, generation)``: which start of an elastic launch this process is; None outside one (pure).

    Raises:
        EnvironmentValueError: either variable set to anything but a count, naming it.
    """
    fix = "ringtrain launch sets it for the job it starts; unset it"
    job = env_int(env, ENV_JOB, None, fix=fix, everywhere=True)
    generation = env_int(env, ENV_GENERATION, 0, fix=fix, everywhere=True)
    return None if job is None else (job, generation)


def write_notice(directory, generation, changes):
    """Tell the job the hosts changed: its next commit stops it for a restart."""
    write_json_atomic(os.path.join(directory, _NOTICE), {"generation": generation, "changes": sorted(changes)})


def read_notice(directory):
    """``(generation, changes)`` of the latest host notice, or None when there is none (or it is unreadable)."""
    return _read_json(os.path.join(directory, _NOTICE), lambda d: (int(d["generation"]), list(d["changes"])))


def write_listening(directory, job):
    """Say that start ``job`` of the job watches the host notices (rank 0 of ``hvd.elastic.run`` calls it)."""
    write_json_atomic(os.path.join(directory, _LISTENING), {"job": int(job)})


def is_listening(directory, job):
    """True when start ``job`` of the job said it watches the host notices."""
    return _read_json(os.path.join(directory, _LISTENING), lambda d: int(d["job"]) == job) is True


def _read_json(path, take):
    """``take(json)`` of a small regular file of this user's at ``path``, never through a link; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            # Another user's file (left from when the directory was shared, and still theirs to rewrite)
            # would let them stop the job at every commit, or keep the launcher from signalling it.
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return None
            return take(json.loads(fh.read(_MAX_JSON + 1)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- a directory only its user can write ------------------------------------------

def directory_problem(path, link_ok=True):
    """Why ``path`` may not hold a job's logs or commits, in words; None when it is the user's own.

    A directory another user owns, or one that others may write, lets them
    plant files that pass for the job's: a commit that runs their code
    when it is unpickled, a log that blames the wrong rank. So does one
    under a directory they may write, where they can rename it away and put
    their own in its place: every directory above it is checked as ssh
    checks the path to a key (:func:`ancestor_problem`). ``link_ok`` False
    refuses a symbolic link at ``path`` (the entries under the commit
    directory); otherwise a link is allowed when it is the user's own, and
    its target is what is checked.
    """
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            if not link_ok:
                return "is a symbolic link, which is never followed here"
            if st.st_uid != os.geteuid():
                return f"is a symbolic link owned by {_user(st.st_uid)}, not by you ({_user(os.geteuid())})"
            st = os.stat(path)
    except OSError as exc:
        return os_reason(exc)
    if not stat.S_ISDIR(st.st_mode):
        return f"is {file_kind(st.st_mode) or 'a regular file'}, not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by {_user(st.st_uid)}, not by you ({_user(os.geteuid())})"
    writable = _writers(st)
    if writable:
        return f"is writable by its {' and '.join(writable)} (mode {stat.S_IMODE(st.st_mode):04o})"
    return ancestor_problem(path)


def ancestor_problem(path):
    """Why a directory above ``path`` would let another user swap ``path`` for their own; None when none would.

    ssh's rule for the path to a key file: every directory above the real
    path must be owned by root or the user, and writable by nobody else
    unless it is sticky (as ``/tmp`` is, where only an entry's owner may
    rename it); the write bit of a group that is the owner's alone does not
    count (:func:`owners_own_group`). The real place of every link on the
    way is checked too: whoever may write there may point the link elsewhere. A directory not
    made yet is skipped: the launcher makes it, mode 0700.
    """
    for parent in _ancestors(path):
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"is under {parent}, which cannot be checked ({os_reason(exc)})"
        if st.st_uid not in (0, os.geteuid()):
            return f"is under {parent}, which {_user(st.st_uid)} owns, not you or root"
        writable = _writers(st)
        if writable and not st.st_mode & stat.S_ISVTX:
            return (f"is under {parent}, which its {' and '.join(writable)} may write and which is not sticky "
                    f"(mode {stat.S_IMODE(st.st_mode):04o})")
    return None


def _writers(st):
    """Who besides its owner may write what ``st`` describes: ``["group"]``, ``["others"]``, both, or none.

    The group's write bit is no one else's when the group is the owner's
    own (:func:`owners_own_group`): Debian, Ubuntu and Fedora give each user
    such a group and umask 002, so a clone or a ``mkdir`` there is mode
    0775, and Debian's ssh accepts that mode on the path to a key.
    """
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writable == ["group"] and is_owners_own_group(st.st_uid, st.st_gid):
        return []
    return writable


def owners_own_group(uid, gid, primary, members, owner):
    """True when group ``gid`` is the primary group of user ``uid`` and holds nobody else (pure).

    Args:
        uid: the owner of the directory.
        gid: its group.
        primary: ``(name, uid)`` of every user the system lists whose primary group is ``gid``.
        members: the names the group lists as its other (supplementary) members.
        owner: ``(name, primary gid)`` of ``uid``, or None when the system does not know it.
    """
    if owner is None or owner[1] != gid:
        return False
    return all(who == uid for _, who in primary) and all(name == owner[0] for name in members)


def is_owners_own_group(uid, gid):
    """:func:`owners_own_group` on what the user and group databases say of ``uid`` and ``gid``."""
    return owners_own_group(uid, gid, *_group_users(uid, gid))


def _group_users(uid, gid):
    """``(primary, members, owner)`` for :func:`owners_own_group`; an owner or group unknown gives None."""
    try:
        import grp
        import pwd

        members = list(grp.getgrgid(gid).gr_mem)
        owner = pwd.getpwuid(uid)
        primary = [(u.pw_name, u.pw_uid) for u in pwd.getpwall() if u.pw_gid == gid]
    except (ImportError, KeyError):
        return [], [], None
    return primary, members, (owner.pw_name, owner.pw_gid)


def _ancestors(path):
    """The directories above ``path``'s real place and above each link's on the way, from ``/`` down (pure)."""
    path = os.path.abspath(path)
    places = {os.path.dirname(os.path.realpath(path))}
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        places.add(os.path.realpath(path))
    found = set()
    for place in places:
        while place not in found:
            found.add(place)
            place = os.path.dirname(place)
    return sorted(found, key=lambda p: (p.count(os.sep), p))


def _user(uid):
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_private_directory(path, what, link_ok=True):
    """Refuse ``path`` in one line (UsageError) unless it is a directory only this user can write.

    ``what`` names it in the message: ``"-o"`` gives ``-o PATH: ...``.
    """
    problem = directory_problem(path, link_ok)
    if problem is None:
        return
    if problem.startswith("is under"):
        _refuse_ancestor(path, what, problem)
    if problem.startswith(("is owned", "is writable", "is a symbolic link owned")):
        raise UsageError(f"{what} {path}: {problem}; another user could plant files there that pass for the "
                         f"job's; give a directory of your own that only you can write (chmod go-w, or a new one)")
    raise UsageError(f"{what} {path}: {problem}; give a directory of your own")


def check_ancestors(path, what):
    """Refuse ``path`` in one line (UsageError) when a directory above it would let another user swap it."""
    problem = ancestor_problem(path)
    if problem is not None:
        _refuse_ancestor(path, what, problem)


def _refuse_ancestor(path, what, problem):
    raise UsageError(f"{what} {path}: {problem}; another user could put a directory of theirs in its place; give "
                     "one whose every parent is yours or root's and writable only by its owner (or sticky, as "
                     "/tmp is)")


def make_private_directory(path, what, link_ok=True):
    """Create ``path`` (mode 0700) if it is missing, then check it is the user's own (UsageError).

    Nothing is made under a directory that fails :func:`ancestor_problem`.
    """
    check_ancestors(path, what)
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot create it ({os_reason(exc)}); choose another directory") from None
    check_private_directory(path, what, link_ok)  # after: another user may have made it first


# --- the key ------------------------------------------------------------------------

def make_key(directory):
    """The directory's commit key, made now (mode 0600, never through a link) if there is none; returns it.

    Raises:
        UsageError: one line, when the key file there is not the user's private regular file.
    """
    path = os.path.join(directory, KEY_FILE)
    try:
        fd = create_new(path, 0o600)
    except FileExistsError:
        return read_key(directory)
    except OSError as exc:
        raise UsageError(f"cannot create the commit key {path} ({os_reason(exc)}); give another {ENV_DIR}") from None
    try:
        key = secrets.token_bytes(_KEY_BYTES)
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def read_key(directory):
    """The directory's commit key, or None when it has none.

    Raises:
        UsageError: the key file is a link, not a regular file, not the
            user's, readable or writable by others, or not a key.
    """
    path = os.path.join(directory, KEY_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "is a symbolic link, which is never followed" if exc.errno == errno.ELOOP else os_reason(exc)
        raise UsageError(f"the commit key {path} {why}; remove it") from None
    try:
        st = os.fstat(fd)
        problem = (f"is {file_kind(st.st_mode)}" if not stat.S_ISREG(st.st_mode) else
                   f"is owned by {_user(st.st_uid)}, not by you" if st.st_uid != os.geteuid() else
                   f"may be read or written by others (mode {stat.S_IMODE(st.st_mode):04o}, not 0600)"
                   if st.st_mode & 0o077 else None)
        key = os.read(fd, _KEY_BYTES + 1) if problem is None else b""
    finally:
        os.close(fd)
    if problem is None and len(key) != _KEY_BYTES:
        problem = f"holds {len(key)} bytes, not a key of {_KEY_BYTES}"
    if problem is not None:
        raise UsageError(f"the commit key {path} {problem}; remove it (the commits it signed are then not "
                         "restored)")
    return key


def commit_mac(key, arrays, fields):
    """HMAC-SHA256, in hex, of a commit's arrays and its JSON ``fields`` under ``key`` (pure)."""
    mac = hmac.new(key, b"ringtrain-commit\0", "sha256")
    hash_arrays(mac, arrays)
    mac.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    return mac.hexdigest()


# --- the store --------------------------------------------------------------------

class CommitStore:
    """A job's commit directory and its host notices, as the launcher set them in the environment.

    Args:
        directory: ``$RINGTRAIN_ELASTIC_DIR``.
        job: which start of the job this is (``$RINGTRAIN_ELASTIC_JOB``).
        generation: the host notices' generation this start began at.
    """

    def __init__(self, directory, job=0, generation=0):
        self.directory = os.path.abspath(directory)
        self.commits = os.path.join(self.directory, COMMITS)
        self.job, self.generation = job, generation

    @classmethod
    def from_env(cls, env=None):
        """The store the environment names, or None outside an elastic launch (commits stay in memory)."""
        env = os.environ if env is None else env
        if not env.get(ENV_DIR):
            return None
        job, generation = elastic_start(env) or (0, 0)
        return cls(env[ENV_DIR], job, generation)

    def encode(self, snapshot):
        """``(arrays, fields)`` of ``snapshot``: here one pickle; a framework's store keeps its tensors apart."""
        return {_STATE: np.frombuffer(pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)}, {}

    def decode(self, arrays):
        """The snapshot :meth:`encode` wrote (called only on a commit whose HMAC verified)."""
        return pickle.loads(arrays[_STATE].tobytes())

    def prepare(self):
        """Check the directory is the user's, make ``commits/`` (0700) and the key; returns the key."""
        make_private_directory(self.directory, ENV_DIR)
        if _not_a_directory(self.commits):
            return make_key(self.directory)  # the write fails, naming the file it could not write
        make_private_directory(self.commits, ENV_DIR, link_ok=False)
        return make_key(self.directory)

    def write(self, sequence, snapshot, size, finished=False):
        """Write commit number ``sequence`` (whole, or not at all), signed with the key; returns its path.

        Raises:
            UsageError: the directory is not the user's, or (CheckpointError)
                one line naming the file and why it could not be written.
        """
        key = self.prepare()
        arrays, meta = self.encode(snapshot)
        meta.update(elastic_format=FORMAT, size=size, finished=bool(finished), sequence=sequence)
        meta["hmac"] = commit_mac(key, arrays, meta)
        return save_checkpoint(self.commits, sequence, arrays, meta, keep=_KEEP)

    def latest(self, warn=None):
        """``(sequence, snapshot, metadata)`` of the newest commit that verifies, or None when there is none.

        A commit that is damaged, not a regular file, or not signed with
        this directory's key is skipped with one line through ``warn``
        (default :func:`warnings.warn`), falling back to the one before; it
        is never unpickled.
        """
        found = self.newest_verified(warn)
        if found is None:
            return None
        arrays, meta = found
        return meta["step"], self.decode(arrays), meta

    def newest_verified(self, warn=None):
        """``(arrays, metadata)`` of the newest commit whose HMAC verifies, not unpickled; None when none does.

        The check rank 0 makes before it restores, so the launcher can say
        truly whether the job will resume. Commits skipped are named through
        ``warn``, as for :meth:`latest`.

        Raises:
            UsageError: the directory, its ``commits/`` or its key is not the user's own.
        """
        warn = warn or _warn
        if not os.path.lexists(self.directory):
            return None
        check_private_directory(self.directory, ENV_DIR)
        if not os.path.lexists(self.commits) or _not_a_directory(self.commits):
            return None  # nothing was ever committed here
        check_private_directory(self.commits, ENV_DIR, link_ok=False)
        key = read_key(self.directory)
        for path in list_checkpoints(self.commits):
            arrays, meta = self._verified(path, key, warn)
            if arrays is not None:
                return arrays, meta
        return None

    def _verified(self, path, key, warn):
        """``(arrays, meta)`` of the commit at ``path`` if it is whole and signed with ``key``, else (None, None)."""
        try:
            kind = file_kind(os.lstat(path).st_mode)
        except OSError:
            return None, None  # pruned since it was listed
        if kind is not None:
            warn(f"skipping {path}: it is {kind}, which is never followed or read here; not restored")
            return None, None
        try:
            arrays, meta = read_checkpoint(path, follow=False)
        except CheckpointTooNew:
            raise
        except CheckpointError as exc:
            warn(f"skipping damaged {exc}; not restored")
            return None, None
        fields = {k: v for k, v in meta.items() if k not in ("format", "format_version", "step", "sha256", "hmac")}
        stored = meta.get("hmac")
        if key is None or not isinstance(stored, str) or meta.get("sequence") != meta["step"] or \
                not hmac.compare_digest(stored, commit_mac(key, arrays, fields)):
            why = f"there is no {KEY_FILE} to check it against" if key is None else \
                f"its HMAC does not match {os.path.join(self.directory, KEY_FILE)}"
            warn(f"commit {path} was not written by this directory's launches ({why}); not restored, never "
                 "unpickled: remove it")
            return None, None
        if meta.get("elastic_format") != FORMAT or _STATE not in arrays:
            raise CheckpointError(f"{path} is not a commit of hvd.elastic (format {meta.get('elastic_format')!r}); "
                                  f"remove it, or give another {ENV_DIR}")
        return arrays, meta

    def notice(self):
        """The generation of the launcher's latest host notice and what changed, or None."""
        return read_notice(self.directory)

    def listen(self):
        """Tell the launcher that this start watches its host notices (so it need not send SIGUSR1)."""
        make_private_directory(self.directory, ENV_DIR)
        write_listening(self.directory, self.job)


def _not_a_directory(path):
    """True for a file that is neither a directory nor a link (a link is refused, never passed over)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


def _warn(line):
    warnings.warn(line, stacklevel=3)

