"""What an event source hands its consumer: deliveries, and per-publisher health."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .events import KVEventBatch


class DeliveryKind(enum.Enum):
    BATCH = "batch"  #: a batch (``batch`` decoded, or ``payload`` raw), in sequence order for its publisher
    RESET = "reset"  #: the publisher's sequence went backwards (it restarted): drop its state
    GAP = "gap"  #: batches were lost for good (replay could not cover them); ``missed`` says how many


@dataclass(slots=True)
class Delivery:
    kind: DeliveryKind
    publisher: str  #: the publisher's identity: its name in the subscriber's config, else its PUB endpoint
    topic: str
    seq: int  #: BATCH: the batch's seq; RESET: the first seq after the restart; GAP: the first missing seq
    batch: KVEventBatch | None = None  #: BATCH: the decoded batch only (None from a raw source)
    recv_ts: float = 0.0  #: wall-clock seconds when the frame was received
    missed: int = 0  #: GAP only: how many batches were lost
    replayed: bool = False  #: BATCH only: it came from the replay socket, not live
    reason: str = ""  #: GAP only: "lost" (replay could not cover it) or "malformed" (an undecodable payload)
    #: BATCH from a raw source (``Subscriber(raw=True)``, ``RecordingSource(decode=False)``): the
    #: payload bytes, undecoded (``batch`` is then None; never bytes in ``batch``); the consumer
    #: decodes it (``KVRouter.apply_payload`` does, in C where it is built)
    payload: bytes | None = None


class HealthState(enum.Enum):
    CONNECTING = "CONNECTING"  #: nothing heard from the publisher yet (no frame, no replay answer or probe)
    SYNCED = "SYNCED"
    RECOVERING = "RECOVERING"  #: a gap was seen and a replay is outstanding
    #: no evidence of life for longer than the configured stale time: nothing received, no
    #: connection up, and no replay answer (a quiet publisher whose connection is up, or whose
    #: replay socket answers its idle probes, stays SYNCED however long it is quiet)
    STALE = "STALE"


@dataclass(slots=True)
class PublisherHealth:
    publisher: str
    state: HealthState = HealthState.SYNCED
    last_seq: int = -1
    last_recv_ts: float = 0.0
    received: int = 0
    gaps: int = 0
    recovered: int = 0  #: batches delivered from replay to fill gaps
    unrecoverable: int = 0  #: batches lost for good
    resets: int = 0  #: restarts seen: the seq went backwards, or the last batch's fingerprint changed
    replay_requests: int = 0  #: replay requests asked for (each gap, late join, retry)
    replay_timeouts: int = 0  #: replay requests whose answer did not end in time (given up)
    malformed: dict[str, int] = field(default_factory=dict)  #: by kind: frames, seq, payload, replay
    probes: int = 0  #: replay probes sent while the publisher was quiet (finds a tail lost while idle)
    join_retries: int = 0  #: late join: initial replay requests sent again (no answer in time)
    reconnects: int = 0  #: the publisher came back over a new connection (each one is checked for a restart)
    unverified_resets: int = 0  #: RESETs on a reconnect that could not be checked (no replay endpoint, no answer)
    #: live batches dropped at a reconnect, from the connection the publisher left (or not told apart
    #: from it): the old run's tail after the RESET, or new-run seqs inside its GAP / replay
    old_conn_dropped: int = 0
    delivered: int = 0  #: batches delivered in order, live and replayed (the consumer applies these)
    last_answer_ts: float = 0.0  #: when its replay socket last answered (a replay, a probe, an end marker)
    #: the transport's word on its connection: True up, False down, None not known (a source with
    #: no connections: a recording, the event plane)
    connected: bool | None = None
    disconnects: int = 0  #: connections to the publisher lost (each one counted)
    #: idle probes answered from past the last delivered batch on an unbroken connection: the
    #: ring moved on while the subscriber lagged; nothing concluded from them (never a RESET)
    probes_moot: int = 0
