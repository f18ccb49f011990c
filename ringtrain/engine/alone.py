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

Calls of one record whose names are as long (a name called again and again,
or Horovod's numbered default names) share what they can (:class:`_Lone`):
the buffer this rank's announcement is written into, and how each member's
began last time (its rank, record id and the name's length), with a buffer
to receive the next one into. A call checks a member's announcement by
comparing its bytes with those and with its own name, not by decoding it.
"""

import os
import struct
import time

import numpy as np

from . import kernels
from .errors import HorovodInternalError
from .negotiation import Announcement, user_name

__all__ = ["ALONE_TAG", "LonePath", "as_runtime_error", "parse_alone", "same_call"]

ALONE_TAG = 8       # an announcement sent alone (LonePath.run_alone), raw: _ALONE's fields, the key, the data
                    # (from the next multiple of 8 bytes)
_ALONE = struct.Struct("<iiH")  # rank, record id, the key's length in bytes
_KEY_CHARS = 0xFFFF // 4        # the longest key whose UTF-8 surely fits _ALONE's length (longer: the general path)
_NO_RECORDS = {}    # (read only: a member no record was heard from yet)
_KEPT_BYTES = 16 << 20  # the buffer bytes kept for lone calls (this rank's and its members'), oldest dropped first;
                        # ever-new names or shapes would otherwise keep one each for good


class _Peer:
    """How one member's lone announcements of a record began (``fields``: its rank, record id, the name's length),
    and where the next one is received (``raw``; ``data``, its data as a flat array of this rank's array's dtype)."""

    __slots__ = ("rank", "fields", "raw", "data", "record_id", "records", "known")

    def __init__(self, rank, raw, data_at, record_id, records, dtype):
        self.rank, self.record_id, self.records = rank, record_id, records
        self.fields = bytes(raw[:_ALONE.size])
        self.raw = bytearray(len(raw))
        self.data = np.frombuffer(self.raw, dtype, offset=data_at)  # (the kernels take it as they take the array)
        self.known = records[record_id]  # their record, as their id names it now (checked each call)

    def as_read(self, key):
        """The announcement last received into :attr:`raw` (checked to name ``key``), as
        :meth:`LonePath._join_general` takes one (a copy: the buffer is received into again)."""
        return "a", (self.rank, [(key, self.record_id, None, None, memoryview(self.data.tobytes()))])


class _Lone:
    """The lone calls of one record with names of one length: this rank's announcement (``raw``; its data a view
    ``data`` like the op's array) and the members' (:class:`_Peer`, by index in the set's communicator, once heard)."""

    __slots__ = ("record", "fields", "data_at", "raw", "data", "sends", "peers", "nbytes")

    def __init__(self, record, fields, length, array, members):
        self.record, self.fields, self.data_at = record, fields, _aligned(_ALONE.size + length)
        self.nbytes = (self.data_at + array.nbytes) * members  # (its buffer, and each member's once heard)
        self.peers = {}
        self.sends = []
        self._fresh(array)

    def _fresh(self, array):
        """A new buffer for this rank's announcement (the last may still be on its way)."""
        self.raw = bytearray(self.data_at + array.nbytes)
        self.raw[:_ALONE.size] = self.fields
        self.data = np.frombuffer(self.raw, array.dtype, offset=self.data_at).reshape(array.shape)
        self.sends = []

    def write(self, name, array):
        """This rank's announcement of ``array`` named ``name`` (UTF-8): :attr:`raw`, the name and data copied in."""
        if array.dtype != self.data.dtype:  # one record, two NumPy types (bfloat16 as uint16 with dtype=, or not)
            self._fresh(array)
            self.peers = {}
        elif self.sends:
            self.sends = [r for r in self.sends if not r.Test()]
            if self.sends:
                self._fresh(array)
        self.raw[_ALONE.size:_ALONE.size + len(name)] = name
        np.copyto(self.data, array)
        return self.raw


class LonePath:
    """:class:`~ringtrain.engine.protocol.Protocol`'s lone small allreduce (its state is the protocol's)."""

    def can_run_alone(self, entry):
        """Whether ``entry``, the only op queued, may take :meth:`run_alone`: a small allreduce on an idle set.

        (Not for a name this rank has been told of a conflict of across sets:
        a lone announcement has no field for how many, which the general path's carry.)
        """
        return (entry.local and entry.kind == "allreduce" and self._others and not self._mine and not self._ordered
                and not self._to_order and not self._answers and not self._failed_joined and self._board.empty()
                and self.engine.timeline is None and not (self.engine.conflicts_passed
                                                          and user_name(entry.key) in self.engine.conflicts_passed)
                and self._record_ids.get(id(entry.record), (None,))[0] is entry.record
                and len(entry.key) <= _KEY_CHARS)

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
        name = key.encode(errors="surrogatepass")  # (a name from os.fsdecode may hold lone surrogates)
        lone = self._lones.get((id(record), len(name)))
        if lone is None:
            lone = self._lone(record, len(name), array)
        got, read, fast = {self.rank: (array, record)}, [], []
        try:
            self._send_raw(lone, lone.write(name, array))
            heard = self._hear_alone(key, name, lone, got, read, fast, spin, patience)
        except BaseException:  # (a Ctrl-C while waiting: the op is announced, so it must be where step finds it;
            # one that came before every member was sent it leaves the op to the stall bounds, not a name
            # stuck in flight for good)
            self._join_general(entry, [peer.as_read(key) for peer in fast] + read)
            raise
        if heard:
            self._finish_alone(entry, got)
            return True
        self._join_general(entry, [peer.as_read(key) for peer in fast] + read)
        return False

    def _send_raw(self, lone, raw):
        """Send a lone announcement to every member (raw: any member's :meth:`_next_message` reads it)."""
        for r in self._others:
            request = self.control.Isend([raw, self._byte], dest=self._index[r], tag=ALONE_TAG)  # (it holds raw)
            if not request.Test():
                lone.sends.append(request)
                self._sends.append(request)

    def _lone(self, record, length, array):
        """A new :class:`_Lone` for calls of ``record`` with names ``length`` bytes long (its id is announced:
        :meth:`can_run_alone`), kept unless it alone would take a quarter of the bound."""
        fields = _ALONE.pack(self.rank, self._record_ids[id(record)][1], length)
        lone = _Lone(record, fields, length, array, len(self.ranks))
        if lone.nbytes > _KEPT_BYTES // 4:
            return lone
        lones = self._lones
        while lones and self._lone_bytes + lone.nbytes > _KEPT_BYTES:
            self._lone_bytes -= lones.pop(next(iter(lones))).nbytes  # (the oldest: dicts keep their order)
        self._lone_bytes += lone.nbytes
        lones[(id(record), length)] = lone  # (it keeps record alive, so the id in the key is not reused)
        return lone

    def _receive_alone(self, message):
        """The raw lone announcement probed in ``self._status`` (:func:`parse_alone` reads it)."""
        raw = bytearray(self._status.Get_count(self._byte))
        message.Recv([raw, self._byte])
        return raw

    def _hear_alone(self, key, name, lone, got, read, fast, spin, patience):
        """Read members' lone announcements of ``key`` into ``got`` (their data and records): True once every
        member's is in.

        A member's announcement that begins as its last one of the record
        did (its rank, its record id, still naming the same record, a name
        as long) and names ``name`` (the key's UTF-8) is received into that
        member's buffer and goes to ``fast``; any other message is decoded
        and goes to ``read``, as :meth:`_next_message` would have read it.
        Stops (False) at the first message that is not a member's lone
        announcement of the key with a record equal to this rank's, after
        ``patience`` seconds, or as soon as another op is queued here (it
        must be announced, and the channel's thread cannot while this one
        drives).
        """
        improbe, status, byte, peers, start = self.control.improbe, self._status, self._byte, lone.peers, None
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
            # A member's buffer is received into only while nothing of that member's is in got: its next call's
            # announcement may come before a third member's of this one, and must not overwrite what got holds.
            peer = peers.get(status.Get_source())
            if peer is not None and status.Get_count(byte) == len(peer.raw) and peer.rank not in got:
                message.Recv([peer.raw, byte])
                if same_call(peer.raw, peer.fields, name) and peer.records.get(peer.record_id) is peer.known:
                    fast.append(peer)
                    got[peer.rank] = (peer.data, peer.known)
                elif not self._take_decoded(bytes(peer.raw), key, lone, got, read):
                    return False
            elif not self._take_decoded(self._receive_alone(message), key, lone, got, read):
                return False
            if len(got) == len(self.ranks):
                return True

    def _take_decoded(self, raw, key, lone, got, read):
        """A member's lone announcement ``raw``, decoded, onto ``read``; into ``got`` (and kept as how that member's
        begin, :class:`_Peer`) if it is of ``key`` with a record equal to this rank's and the first of its rank's
        here: else False."""
        rank, record_id, theirs, data = parse_alone(raw)
        read.append(("a", (rank, [(theirs.decode(errors="surrogatepass"), record_id, None, None, data)])))
        matched = self._matching(*read[-1], key, lone.record)
        if matched is None or rank in got:
            return False
        got[rank] = matched
        lone.peers[self._index[rank]] = _Peer(rank, raw, len(raw) - len(data), record_id, self._records[rank],
                                              lone.data.dtype)
        return True

    def _finish_alone(self, entry, got):
        """Compute ``entry`` from every member's data, with the first member's record (as the verdict picks it)."""
        record = got[self.ranks[0]][1]  # (equal to every other, but equal is not the same: -0.0 == 0.0)
        try:
            result = kernels.reduce_locally(record, [got[r][0] for r in self.ranks], entry.args[1])
        except Exception as exc:  # noqa: BLE001 - the caller gets it from synchronize
            self._complete(entry, error=as_runtime_error(exc, entry.label))
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
        known = self._records.get(body[0], _NO_RECORDS).get(record_id)
        if known is None or (known is not record and known != record):
            return None
        return data, known

    def _join_general(self, entry, read):
        """``entry``, announced by :meth:`run_alone`, and the messages it read, where :meth:`step` puts them."""
        now = time.monotonic()
        self._mine[entry.key] = entry
        self._board.add(self.rank, entry.key, Announcement(entry.record, None, entry.args[0]), now)
        for kind, body in read:
            self._act(kind, body, now)


def same_call(raw, fields, name):
    """Whether the lone announcement ``raw`` begins with ``fields`` (a member's rank, record id and a name's length,
    as its last one of a record did) and names ``name`` (UTF-8) (pure; its length, and so its data's, the
    caller has checked: the buffer it was received into is that long)."""
    return raw.startswith(fields) and raw.startswith(name, _ALONE.size)


def parse_alone(raw):
    """A raw lone announcement's ``(rank, record id, the key's UTF-8, data)`` (pure; the data a view of ``raw``)."""
    rank, record_id, length = _ALONE.unpack_from(raw)
    end = _ALONE.size + length
    return rank, record_id, raw[_ALONE.size:end], memoryview(raw)[_aligned(end):]


def _aligned(offset):
    """Where a raw announcement's data starts after ``offset`` bytes: a multiple of 8, so its view is aligned."""
    return -(-offset // 8) * 8


def as_runtime_error(exc, label):
    """``exc``, raised running op ``label``, as the error a caller gets from ``synchronize``: a RuntimeError as
    it is, else a HorovodInternalError naming the op."""
    return exc if isinstance(exc, RuntimeError) else HorovodInternalError(f"{label}: {type(exc).__name__}: {exc}")
