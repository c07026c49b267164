"""The ZeroMQ wire's frame shapes, in one place (identical to vLLM's ``ZmqEventPublisher``).

* live (PUB -> SUB): ``[topic, seq, payload]``; ``seq`` is 8 bytes big-endian unsigned, from 0;
* replay request (DEALER -> ROUTER): ``[b"", start_seq]`` (8 bytes big-endian unsigned);
* replay answer (ROUTER -> DEALER), one per buffered batch whose seq >= start:
  ``[b"", topic, seq, payload]``;
* end of a replay answer: ``[b"", b"", END_SEQ, b""]``, ``END_SEQ`` being -1 as 8 signed
  big-endian bytes (``b"\\xff" * 8``).

The ROUTER side sees each message prefixed with the DEALER's identity frame.
"""

from __future__ import annotations

import struct

__all__ = ["END_SEQ", "PROBE_SEQ", "SEQ_BYTES", "pack_seq", "unpack_seq", "replay_request", "parse_replay_request",
           "replay_answer", "end_marker", "is_end_marker", "is_replay_answer", "is_live"]

SEQ_BYTES = 8
#: the end marker's seq frame: -1 as 8 signed big-endian bytes
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
#: a start seq no ring holds: the answer is only the end marker (a reachability probe)
PROBE_SEQ = ((1 << 64) - 1).to_bytes(SEQ_BYTES, "big")

#: ``seq`` (an unsigned 64-bit int) as its 8-byte frame
pack_seq = struct.Struct(">Q").pack


def unpack_seq(frame: bytes) -> int:
    """An 8-byte seq frame as an unsigned int."""
    return int.from_bytes(frame, "big")


def replay_request(start: int) -> tuple[bytes, bytes]:
    """A DEALER's request for every buffered batch from ``start`` on."""
    return (b"", start.to_bytes(SEQ_BYTES, "big"))


def parse_replay_request(frames: list[bytes]) -> tuple[bytes, int] | None:
    """``[identity, b"", start]`` as received by the ROUTER -> ``(identity, start)``; None if malformed."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
        return None
    return frames[0], int.from_bytes(frames[2], "big")


def replay_answer(ident: bytes, topic: bytes, seq: int, payload: bytes) -> tuple[bytes, ...]:
    """One replayed batch, addressed to the DEALER ``ident``."""
    return (ident, b"", topic, seq.to_bytes(SEQ_BYTES, "big"), payload)


def end_marker(ident: bytes) -> tuple[bytes, ...]:
    """The end of a replay answer, addressed to the DEALER ``ident``."""
    return (ident, b"", b"", END_SEQ, b"")


def is_end_marker(frames: list[bytes]) -> bool:
    """Whether a message a DEALER received (``[b"", topic, seq, payload]`` shape) is the end marker."""
    return len(frames) == 4 and frames[0] == b"" and frames[2] == END_SEQ


def is_replay_answer(frames: list[bytes]) -> bool:
    """Whether a message a DEALER received is a well-formed replay answer (the end marker included)."""
    return len(frames) == 4 and frames[0] == b"" and len(frames[2]) == SEQ_BYTES


def is_live(frames: list[bytes]) -> bool:
    """Whether a message a SUB received is a well-formed live message ``[topic, seq, payload]``."""
    return len(frames) == 3 and len(frames[1]) == SEQ_BYTES
