"""The common case on its own: a blocking small allreduce on an idle set, announced and computed in one exchange.

:class:`LonePath` is the part of :class:`~ringtrain.engine.protocol.Protocol`
that serves a loop of blocking small allreduces (the common op of a
training step's helpers and metrics) without the board, the queue or a
handle: the caller's thread sends its announcement with the data, reads
every member's, and reduces them where it stands. The announcement is the
general path's (sent raw, :data:`ALONE_TAG`), so a member need not know
which way a rank took; anything unexpected (another message, another
record, a late member) hands the op and what was read to the general path,
whose errors, stalls and bounds then apply. Like the rest of the protocol,
only the set's driving thread runs it.
"""

import os
import struct
import time

from . import kernels
from .errors import HorovodInternalError
from .negotiation import Announcement, user_name

__all__ = ["ALONE_TAG", "LonePath", "as_runtime_error"]

ALONE_TAG = 8       # an announcement sent alone (LonePath.run_alone), raw: _ALONE's fields, the key, the data
                    # (from the next multiple of 8 bytes)
_ALONE = struct.Struct("<iiH")  # rank, record id, the key's length in bytes
_KEY_CHARS = 0xFFFF // 4        # the longest key whose UTF-8 surely fits _ALONE's length (longer: the general path)
_NONE = (None, None)
_NO_RECORDS = {}    # (read only: a member no record was heard from yet)


class LonePath:
    """:class:`~ringtrain.engine.protocol.Protocol`'s lone small allreduce (its state is the protocol's)."""

    def _receive_alone(self, message):
        """A lone announcement probed in ``self._status``: ``(rank, record id, the key's UTF-8, data)``."""
        raw = bytearray(self._status.Get_count(self._byte))
        message.Recv([raw, self._byte])
        rank, record_id, length = _ALONE.unpack_from(raw)
        end = _ALONE.size + length
        return rank, record_id, raw[_ALONE.size:end], memoryview(raw)[_aligned(end):]

    def can_run_alone(self, entry):
        """Whether ``entry``, the only op queued, may take :meth:`run_alone`: a small allreduce on an idle set.

        (Not for a name this rank has been told of a conflict of across sets:
        a lone announcement has no field for how many, which the general path's carry.)
        """
        return (entry.local and entry.kind == "allreduce" and self._others and not self._mine and not self._ordered
                and not self._to_order and not self._answers and not self._failed_joined and self._board.empty()
                and self.engine.timeline is None and not (self.engine.conflicts_passed
                                                          and user_name(entry.key) in self.engine.conflicts_passed)
                and self._record_ids.get(id(entry.record), _NONE)[0] is entry.record and len(entry.key) <= _KEY_CHARS)

    def run_alone(self, entry, spin, patience):
        """Announce ``entry`` and compute it from the members' announcements, skipping the board: True when done.

        The same announcement as :meth:`step` makes (sent raw, which any
        member's :meth:`_next_message` reads), so the members need not know
        which way a rank took: what is skipped is this rank's bookkeeping
        for the common case of a loop of blocking small allreduces, each
        matched by every member's announcement of the same record within
        ``patience`` seconds (spinning for the first ``spin``, then yielding
        the core between looks). Anything else (another message, another
        record, a late member) returns False with the op and every message
        read put where :meth:`step` would have put them, and the general
        path goes on from there: errors, stalls and bounds are its.
        """
        key, record, array = entry.key, entry.record, entry.args[0]
        head = self._heads.get(key)
        if head is None or head[0] is not record:
            head = self._head(key, record)
        got, read = {self.rank: (array, record)}, []
        try:
            self._send_raw(head[1] + array.tobytes())
            heard = self._hear_alone(key, head[2], record, got, read, spin, patience)
        except BaseException:  # (a Ctrl-C while waiting: the op is announced, so it must be where step finds it;
            # one that came before every member was sent it leaves the op to the stall bounds, not a name
            # stuck in flight for good)
            self._join_general(entry, read)
            raise
        if heard:
            self._finish_alone(entry, got)
            return True
        self._join_general(entry, read)
        return False

    def _send_raw(self, raw):
        """Send a lone announcement to every member (raw: any member's :meth:`_next_message` reads it)."""
        for r in self._others:
            request = self.control.Isend([raw, self._byte], dest=self._index[r], tag=ALONE_TAG)  # (it holds raw)
            if not request.Test():
                self._sends.append(request)

    def _head(self, key, record):
        """``(record, what precedes the data in its lone announcement, the key's UTF-8)``, kept for the next call."""
        name = key.encode(errors="surrogatepass")  # (a name from os.fsdecode may hold lone surrogates)
        fields = _ALONE.pack(self.rank, self._record_ids[id(record)][1], len(name)) + name
        if len(self._heads) >= 4096:
            self._heads.clear()
        head = self._heads[key] = (record, fields + bytes(_aligned(len(fields)) - len(fields)), name)
        return head

    def _hear_alone(self, key, name, record, got, read, spin, patience):
        """Read members' messages into ``read`` and their data for ``key`` (``name``, its UTF-8) into ``got``:
        True once every member's is in.

        Stops (False) at the first message that is not a member's lone
        announcement of the key with ``record``, after ``patience`` seconds,
        or as soon as another op is queued here (it must be announced, and
        the channel's thread cannot while this one drives). The loop is
        :meth:`_next_message` with the match :meth:`_matching` remembers
        checked first, and :meth:`_matching` itself only for anything else:
        it runs for every small blocking op.
        """
        improbe, status, start = self.control.improbe, self._status, None
        while True:
            message = improbe(self._any_source, self._any_tag, status)
            if message is None:
                now = time.monotonic()
                start = now if start is None else start
                if now - start > patience or self.channel.queued():
                    return False
                if now - start > spin:  # (as the general path's driver does: a late peer may need this core)
                    os.sched_yield()
                continue
            if status.Get_tag() != ALONE_TAG:
                read.append(message.recv())
                return False
            rank, record_id, theirs, data = self._receive_alone(message)
            known = self._records.get(rank, _NO_RECORDS).get(record_id)
            kept = self._matched.get((rank, record_id))  # (what _matching remembers of an earlier match)
            if kept is None or kept[0] is not known or kept[1] is not record or theirs != name or rank in got:
                read.append(("a", (rank, [(theirs.decode(errors="surrogatepass"), record_id, None, None, data)])))
                if self._matching(*read[-1], key, record) is None or rank in got:
                    return False
                known = self._records[rank][record_id]
            else:
                read.append(("a", (rank, [(key, record_id, None, None, data)])))
            got[rank] = (data, known)
            if len(got) == len(self.ranks):
                return True

    def _finish_alone(self, entry, got):
        """Compute ``entry`` from every member's data, with the first member's record (as the verdict picks it)."""
        record = got[self.ranks[0]][1]  # (equal to every other, but equal is not the same: -0.0 == 0.0)
        try:
            result = kernels.reduce_locally(record, [got[r][0] for r in self.ranks], entry.args[1])
        except Exception as exc:  # noqa: BLE001 - the caller gets it from synchronize
            self._complete(entry, error=as_runtime_error(exc))
        else:
            self._complete(entry, result)
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]

    def _matching(self, kind, body, key, record):
        """``(data, their record)`` if ``(kind, body)`` is a member's lone announcement of ``key`` with a record
        equal to ``record``, else None."""
        if kind != "a" or len(body[1]) != 1:
            return None
        theirs, record_id, sent, info, data = body[1][0]
        if theirs != key or sent is not None or info is not None or data is None:
            return None
        known = self._records.get(body[0], {}).get(record_id)
        if known is record:
            return data, known
        kept = self._matched.get((body[0], record_id))
        if kept is not None and kept[0] is known and kept[1] is record:
            return data, known
        if known is None or known != record:
            return None
        if len(self._matched) >= 4096:
            self._matched.clear()
        self._matched[(body[0], record_id)] = (known, record)  # both kept alive: their ids are not reused
        return data, known

    def _join_general(self, entry, read):
        """``entry``, announced by :meth:`run_alone`, and the messages it read, where :meth:`step` puts them."""
        now = time.monotonic()
        self._mine[entry.key] = entry
        self._board.add(self.rank, entry.key, Announcement(entry.record, None, entry.args[0]), now)
        for kind, body in read:
            self._act(kind, body, now)


def _aligned(offset):
    """Where a raw announcement's data starts after ``offset`` bytes: a multiple of 8, so its view is aligned."""
    return -(-offset // 8) * 8


def as_runtime_error(exc):
    """``exc`` as the error a caller gets from ``synchronize``: a RuntimeError as it is, else HorovodInternalError."""
    return exc if isinstance(exc, RuntimeError) else HorovodInternalError(f"{type(exc).__name__}: {exc}")
