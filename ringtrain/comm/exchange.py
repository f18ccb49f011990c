"""The mailbox of the header exchange: the send and receive buffers one communicator reuses.

Every collective starts with a header exchange (:func:`ringtrain.comm.header.exchange`);
across hosts it goes by messages from these buffers, and small calls carry
their data after the header in the same message. Small calls are
latency-bound, and Python's own overhead is a large part of a 4 KiB call,
so the buffers, their views and the packed headers are made once and reused.
"""

import numpy as np

from .header import HEADER, HEADER_BYTES
from .policy import SMALL_BYTES

__all__ = ["Mailbox"]


class Mailbox:
    """Send and receive buffers with room for any header plus the largest small payload.

    Attributes:
        send, recv: the whole buffers (uint8).
        send_header, recv_header: their header fields as int64.
        send_bytes, recv_bytes: memoryviews of the two, for cheap compares.
        header_only, heard: MPI message specs for a header alone, and for anything received.
    """

    def __init__(self, MPI):
        self.MPI = MPI
        capacity = HEADER_BYTES + SMALL_BYTES
        self.send = np.empty(capacity, np.uint8)
        self.recv = np.empty(capacity, np.uint8)
        self.send_header = self.send[:HEADER_BYTES].view(np.int64)
        self.recv_header = self.recv[:HEADER_BYTES].view(np.int64)
        self.send_bytes, self.recv_bytes = memoryview(self.send), memoryview(self.recv)
        self.header_only = [self.send[:HEADER_BYTES], MPI.BYTE]
        self.heard = [self.recv, MPI.BYTE]
        self._packed = {}
        self._views = {}

    def packed(self, header):
        """``header`` packed as ``[fields, -fields]``, cached (headers repeat in training loops)."""
        mine = self._packed.get(header)
        if mine is None:
            if len(self._packed) > 1024:  # bounded
                self._packed.clear()
            mine = self._packed[header] = HEADER.pack(*header, *(-v for v in header))
        return mine

    def views(self, dtype, count):
        """(payload, message spec, received payload) for ``count`` elements of ``dtype``, cached."""
        key = (dtype, count)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 1024:
                self._views.clear()
            end = HEADER_BYTES + count * np.dtype(dtype).itemsize
            views = self._views[key] = (self.send[HEADER_BYTES:end].view(dtype),
                                        [self.send[:end], self.MPI.BYTE],
                                        self.recv[HEADER_BYTES:end].view(dtype))
        return views
