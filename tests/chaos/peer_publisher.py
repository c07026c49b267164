"""A publisher process for kill -9 tests:
``python -m tests.chaos.peer_publisher PUB REPLAY RUN [INTERVAL_S] [--connect TOPIC] [--from SEQ] [--no-replay]``.

Publishes one batch every INTERVAL_S (default 0.002) until killed; each batch's ``ts`` is
``RUN * 1e6 + seq`` so a subscriber can tell which run (process) a batch came from, and a
splice (a new run's batch delivered as if it continued the old one) shows. Prints ``ready``.
``--connect TOPIC``: connect to a bind-mode subscriber at PUB under TOPIC. ``--from SEQ``: the
run's first seq is SEQ (a run already past the old one's seq when its first frame arrives, as a
replayer of a recording, or a run whose first batches nobody heard, produces). ``--no-replay``:
no replay socket (REPLAY is ignored).
"""

from __future__ import annotations

import sys
import time

from kvevents import BlockStored, KVEventBatch, encode_batch
from kvevents.publisher import ZmqEventPublisher


def main() -> None:
    args = sys.argv[1:]
    opts = {}
    for flag in ("--connect", "--from"):
        if flag in args:
            i = args.index(flag)
            opts[flag] = args[i + 1]
            del args[i:i + 2]
    no_replay = "--no-replay" in args
    if no_replay:
        args.remove("--no-replay")
    pub_ep, rep_ep, run = args[0], args[1], int(args[2])
    interval = float(args[3]) if len(args) > 3 else 0.002
    topic = opts.get("--connect", "")
    pub = ZmqEventPublisher(pub_ep, None if no_replay else rep_ep, replay_rate=1000.0, replay_burst=100, topic=topic,
                            mode="connect" if "--connect" in opts else "auto")
    print("ready", flush=True)
    seq = int(opts.get("--from", 0))

    def batch(s: int) -> KVEventBatch:
        ev = BlockStored([run * 1_000_000 + s], None, [s] * 4, 4, None, "GPU", None)
        return KVEventBatch(run * 1e6 + s, [ev], 0)

    if seq:
        pub.publish_raw(encode_batch(batch(seq)), seq=seq)  # the counter continues from seq + 1
        seq += 1
        time.sleep(interval)
    while True:
        pub.publish(batch(seq))
        seq += 1
        time.sleep(interval)  # the pace of an engine's steps, not a synchronisation


if __name__ == "__main__":
    main()
