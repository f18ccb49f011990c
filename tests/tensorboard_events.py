"""Reading TensorBoard event files back for the tests: TFRecord frames, checked, then tensorboardX's Event protos."""

import glob
import os
import struct


def read_events(path):
    """Every Event in one event file; each frame's two masked CRC-32Cs are checked as TensorBoard's reader does."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    events = []
    with open(path, "rb") as fh:
        data = fh.read()
    at = 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8:at + 12])[0] == masked_crc32c(header), f"{path}: bad length crc"
        body = data[at + 12:at + 12 + length]
        assert struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == masked_crc32c(body), \
            f"{path}: bad data crc at byte {at}"
        events.append(Event.FromString(body))
        at += 16 + length
    return events


def read_scalars(folder):
    """``{tag: [(step, value), ...]}`` from every event file in ``folder``, and the files' names."""
    files = sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*")))
    scalars = {}
    for path in files:
        for event in read_events(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars, files
