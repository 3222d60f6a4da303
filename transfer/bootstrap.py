"""A Ray-free ZMQ side channel for handshakes and transfer requests; a malformed frame is dropped
and counted. One thread per endpoint object.
"""

from __future__ import annotations

import logging
import time

import zmq

from tandem.core.kv_messages import Message, decode_message

log = logging.getLogger(__name__)

_SEND_TIMEOUT_MS = 5000


class _Endpoint:
    def __init__(self, kind: int):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(kind)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self.dropped = 0

    def _messages(self, timeout_s: float):
        """Yield raw frames as they arrive until ``timeout_s`` has passed without one to return."""
        end = time.monotonic() + timeout_s
        while self._sock.poll(max(0, int((end - time.monotonic()) * 1000)), zmq.POLLIN):
            yield self._sock.recv_multipart()

    def _decode(self, data: bytes) -> Message | None:
        try:
            return decode_message(data)
        except ValueError as e:
            self.dropped += 1
            log.warning("bootstrap: dropped a malformed message (%d bytes): %s", len(data), e)
            return None

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BootstrapServer(_Endpoint):
    """ROUTER socket; peers are addressed by the opaque identity ``recv`` returns."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        super().__init__(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(f"tcp://{host}:{port if port else '*'}")
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def recv(self, timeout_s: float = 0.0) -> tuple[bytes, Message] | None:
        """Next well-formed message and its sender's identity, or None after ``timeout_s``."""
        for frames in self._messages(timeout_s):
            if len(frames) != 2:
                self.dropped += 1
                log.warning("bootstrap: dropped a message of %d frames", len(frames))
                continue
            msg = self._decode(frames[1])
            if msg is not None:
                return frames[0], msg
        return None

    def send(self, peer: bytes, msg: Message) -> None:
        """Send to a connected peer; ConnectionError if it is unknown or gone."""
        try:
            self._sock.send_multipart([peer, msg.encode()])
        except zmq.error.ZMQError as e:
            raise ConnectionError(f"bootstrap: cannot send {type(msg).__name__} to peer {peer!r}: {e}") from e


class BootstrapClient(_Endpoint):
    """DEALER socket connected to one server endpoint."""

    def __init__(self, endpoint: str):
        super().__init__(zmq.DEALER)
        self.endpoint = endpoint
        self._sock.connect(endpoint)

    def send(self, msg: Message) -> None:
        try:
            self._sock.send(msg.encode())
        except zmq.error.Again as e:
            raise TimeoutError(f"bootstrap: send to {self.endpoint} timed out") from e

    def recv(self, timeout_s: float = 0.0) -> Message | None:
        """Next well-formed message, or None after ``timeout_s``."""
        for frames in self._messages(timeout_s):
            msg = self._decode(frames[0]) if len(frames) == 1 else None
            if len(frames) != 1:
                self.dropped += 1
            if msg is not None:
                return msg
        return None

    def request(self, msg: Message, timeout_s: float) -> Message:
        """Send ``msg`` and wait for the next reply; TimeoutError names the endpoint."""
        self.send(msg)
        reply = self.recv(timeout_s)
        if reply is None:
            raise TimeoutError(f"bootstrap: no reply from {self.endpoint} within {timeout_s:.1f}s")
        return reply
