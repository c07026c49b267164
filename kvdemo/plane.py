"""``kvevents demo --event-plane nats``: the fleet topology on one machine.

A local nats-server with JetStream (file storage in a temporary directory, a free loopback
port, users with per-subject permissions: the bridge may write only its engines' subjects, each
replica only its own consumer, cover and snapshot; kvevents.transport.nats.permissions), N engines publishing over ZeroMQ (ipc:// with replay), one bridge putting their batches
into the stream, two router replicas as processes (``python -m kvservice.replica``) reading it,
saving snapshots and purging under the lease. Mid-run replica ``b`` is killed (SIGKILL) and
started again: it restores the newest snapshot and reads the stream from there. At the end
the summary compares both replicas' full-state digests and accounts for every batch; exit code
1 if the replicas differ or anything was lost without being reported.
"""

from __future__ import annotations

import json
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

from kvevents import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
from kvevents.transport.nats.bridge import Bridge, EngineSpec
from kvevents.transport.nats.broker import broker_env, find_nats_server
from kvevents.transport.nats.permissions import auth_config

BLOCK = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, what: str, deadline: float) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)  # polling a process's observable state (a port, a status file)
    raise RuntimeError(f"demo: timed out waiting for {what}")


def _nats_ready(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.recv(4096)
            s.sendall(b"CONNECT {}\r\nPING\r\n")
            answer = s.recv(4096)
            return b"PONG" in answer or b"Authorization Violation" in answer  # (up, and asking for a user)
    except OSError:
        return False


class _Engine:
    """A stand-in engine: shared-prefix prompts become GPU BlockStored chains, some evicted."""

    def __init__(self, name: str, tmp: Path, seed: int) -> None:
        self.name = name
        self.pub_ep, self.rep_ep = f"ipc://{tmp}/{name}.pub", f"ipc://{tmp}/{name}.rep"
        self.pub = ZmqEventPublisher(endpoint=self.pub_ep, replay_endpoint=self.rep_ep, topic=f"kv@{name}@demo")
        self.rng = random.Random(seed)
        self.live: list[int] = []
        self.published = 0

    def step(self) -> None:
        prefix = self.rng.randrange(8)
        tokens = [prefix * 1000 + i for i in range(BLOCK * 4)] + [self.rng.randrange(1 << 20) for _ in range(BLOCK * 2)]
        hashes = [hash((self.name, tuple(tokens[: (i + 1) * BLOCK]))) & ((1 << 63) - 1) for i in range(len(tokens) // BLOCK)]
        events = [BlockStored(hashes, None, tokens, BLOCK, None, "GPU", None)]
        self.live.extend(hashes)
        if len(self.live) > 400:
            gone, self.live = self.live[:100], self.live[100:]
            events.append(BlockRemoved(gone, "GPU"))
        self.pub.publish(KVEventBatch(time.time(), events, 0))
        self.published += 1


def _replica(url: str, name: str, status: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvservice.replica", "--nats", url, "--name", name,
                             "--snapshot-every", "0.5", "--heartbeat", "0.25", "--ttl", "3", "--status-file", str(status)],
                            stdout=subprocess.DEVNULL)


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_plane_demo(*, duration: float = 6.0, engines: int = 3, seed: int = 0, out: TextIO = sys.stdout) -> int:
    server = find_nats_server()
    if server is None:
        print("kvevents demo --event-plane nats needs nats-server on PATH "
              "(Debian/Ubuntu: apt-get install nats-server; or https://nats.io)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="kvplane-"))
    port = _free_port()
    fleet = [_Engine(f"engine-{i}", tmp, seed + i) for i in range(engines)]
    users = [{"user": "bridge", "password": secrets.token_hex(8), "role": "bridge",
              "pods": [("demo", e.name) for e in fleet]}]
    users += [{"user": f"replica-{n}", "password": secrets.token_hex(8), "role": "replica", "name": n} for n in "ab"]
    login = {u["user"]: f"nats://{u['user']}:{u['password']}@127.0.0.1:{port}" for u in users}
    url = f"nats://127.0.0.1:{port}"
    (tmp / "nats.conf").write_text(auth_config(users))
    procs: dict[str, subprocess.Popen] = {}
    nats_proc = subprocess.Popen([server, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(tmp / "js"),
                                  "-c", str(tmp / "nats.conf")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=broker_env())
    bridge = None
    stop = threading.Event()
    try:
        _wait(lambda: _nats_ready(port), "nats-server", 15)
        print(f"nats-server (JetStream, file storage) on {url}, store {tmp / 'js'}; users with per-subject "
              f"permissions: {', '.join(login)}", file=out)
        bridge = Bridge(login["bridge"], [EngineSpec(e.name, e.pub_ep, e.rep_ep, "demo") for e in fleet])
        bt = threading.Thread(target=bridge.run, args=(stop,), daemon=True)
        bt.start()
        files = {n: tmp / f"replica-{n}.json" for n in ("a", "b")}
        for n in files:
            procs[n] = _replica(login[f"replica-{n}"], n, files[n])
        print(f"bridge: {engines} engines -> stream KVEVENTS; replicas a, b (snapshots every 0.5 s, purge lease)", file=out)
        t0 = time.monotonic()
        killed = restarted = False
        next_line = t0 + 1.0
        while time.monotonic() - t0 < duration:
            for e in fleet:
                e.step()
            time.sleep(0.002)  # the engines' step pace: ~500 batches/s each
            now = time.monotonic() - t0
            if not killed and now >= duration / 3:
                procs["b"].send_signal(signal.SIGKILL)
                procs["b"].wait()
                killed = True
                print(f"[{now:4.1f}s] replica b killed (SIGKILL) at position {_status(files['b']).get('position')}", file=out)
            if killed and not restarted and now >= duration / 2:
                files["b"].unlink(missing_ok=True)
                procs["b"] = _replica(login["replica-b"], "b", files["b"])
                restarted = True
                print(f"[{now:4.1f}s] replica b restarted", file=out)
            if time.monotonic() >= next_line:
                next_line += 1.0
                line = " ".join(f"{n}: pos {_status(f).get('position', '-')} ready {_status(f).get('ready', '-')}"
                                for n, f in files.items())
                print(f"[{now:4.1f}s] bridged {bridge.stats['batches']}  {line}", file=out)
        published = sum(e.published for e in fleet)
        _wait(lambda: bridge.stats["batches"] + bridge.stats["gaps"] >= published, "the bridge to forward everything", 30)
        bridge.sender.flush(30)
        stop.set()
        bt.join(5)
        last = bridge.sender.call(bridge.sender.js.stream_info("KVEVENTS")).state.last_seq
        _wait(lambda: all(_status(f).get("position", 0) >= last for f in files.values()), "both replicas at the end", 60)
        time.sleep(0.3)  # one more status write after the last apply (they write every 0.2 s)
        return _summary(fleet, bridge, {n: _status(f) for n, f in files.items()}, published, out)
    finally:
        stop.set()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
        if bridge is not None:
            bridge.close(5)
        for e in fleet:
            e.pub.shutdown()
        nats_proc.terminate()
        nats_proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def _summary(fleet, bridge, st: dict, published: int, out: TextIO) -> int:
    b = bridge.stats
    s = bridge.sender.stats
    print("\n== event plane summary ==", file=out)
    print(f"engines published {published} batches; bridge forwarded {b['batches']} (+{b['resets']} RESET, "
          f"{b['gaps']} GAP control messages); stream acks {s['acked']}, duplicates dropped {s['duplicates']}, "
          f"resent {s['resent']}", file=out)
    for n, r in st.items():
        rep, src = r["replica"], r["source"]
        how = f"warm from snapshot at seq {rep['restored_seq']} in {rep['restore_s'] * 1000:.0f} ms" if rep["restored_seq"] \
            else "cold start"
        print(f"replica {n}: {how}; applied {rep['applied']}, entries {r['entries']}, ready after "
              f"{r['ready_after_s'] or 0:.2f} s, snapshots {rep['snapshots_saved']} ({rep['snapshot_bytes']} B), "
              f"purged {rep['purged']}; gaps {src['stream_gaps']}, duplicates {src['duplicates']}, "
              f"malformed {src['malformed']}; digest {r['digest'][:16]}", file=out)
        trouble = {k: src[k] for k in ("stream_holes", "stream_lost", "hole_gaps", "implied_resets", "rejected", "conflicts",
                                        "forged_reported") if src.get(k)}
        trouble.update({k: rep[k] for k in ("restart_rechecks", "purged_before_read", "restore_failures", "snapshots_refused")
                        if rep.get(k)})
        if trouble or r.get("failures"):
            print(f"  replica {n} detail: {trouble} failures: {r.get('failures')}", file=out)
    same = len({r["digest"] for r in st.values()}) == 1
    lost = published - b["batches"]
    reported = sum(h.unrecoverable for h in bridge.sub.health().values())
    silent = max(0, lost - reported)
    applied_ok = all(r["source"]["stream_gaps"] == 0 and not r["source"].get("stream_holes") for r in st.values())
    print(f"replicas identical: {'YES' if same else 'NO'} (full-state digest{'' if not st['a']['digest'].startswith('partial') else ', partial: this router has no snapshot()'})", file=out)
    print(f"batches lost before the bridge: {lost} (reported as GAP: {reported}); silently lost: {silent}; "
          f"lost inside the plane: {'none' if applied_ok else 'SEE GAPS ABOVE'}", file=out)
    return 0 if same and silent == 0 and applied_ok else 1
