"""Typed ZMQ channels: msgspec frames over ipc:// sockets in a private runtime directory.

A frame that does not decode as the channel's type is logged and dropped; nothing is
ever unpickled.
"""
from __future__ import annotations

import logging
import os
import tempfile

import msgspec
import zmq

log = logging.getLogger("xinfer.ipc")


def runtime_dir() -> str:
    """A fresh 0700 directory for this server's sockets."""
    return tempfile.mkdtemp(prefix="xinfer-")  # mkdtemp creates it with mode 0700


def endpoint(rundir: str, name: str) -> str:
    return f"ipc://{os.path.join(rundir, name)}"


class Codec:
    def __init__(self, typ):
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(typ)

    def encode(self, msg) -> bytes:
        return self.enc.encode(msg)

    def decode(self, frame: bytes):
        """The message, or None for a frame that is not one (logged)."""
        try:
            return self.dec.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("dropped an undecodable frame (%d bytes): %s", len(frame), e)
            return None


def socket(ctx: zmq.Context, kind: int, addr: str, bind: bool):
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    (s.bind if bind else s.connect)(addr)
    return s
