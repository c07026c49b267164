"""A publisher process for kill -9 tests: ``python -m tests.chaos.peer_publisher PUB REPLAY RUN [INTERVAL_S]``.

Publishes one batch every INTERVAL_S (default 0.002) until killed; each batch's ``ts`` is
``RUN * 1e6 + seq`` so a subscriber can tell which run (process) a batch came from, and a
splice (a new run's batch delivered as if it continued the old one) shows. Prints ``ready``.
"""

from __future__ import annotations

import sys
import time

from kvevents import BlockStored, KVEventBatch
from kvevents.publisher import ZmqEventPublisher


def main() -> None:
    pub_ep, rep_ep, run = sys.argv[1], sys.argv[2], int(sys.argv[3])
    interval = float(sys.argv[4]) if len(sys.argv) > 4 else 0.002
    pub = ZmqEventPublisher(pub_ep, rep_ep, replay_rate=1000.0, replay_burst=100)
    print("ready", flush=True)
    seq = 0
    while True:
        ev = BlockStored([run * 1_000_000 + seq], None, [seq] * 4, 4, None, "GPU", None)
        pub.publish(KVEventBatch(run * 1e6 + seq, [ev], 0))
        seq += 1
        time.sleep(interval)  # the pace of an engine's steps, not a synchronisation


if __name__ == "__main__":
    main()
