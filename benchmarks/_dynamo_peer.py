"""NVIDIA Dynamo's ``RadixTree`` as a peer row of ``benchmarks/router.py``, run in Dynamo's own
interpreter (our process never imports dynamo).

Two halves in one file:

- our side (``DynamoPeer``, ``Feed``, ``find_python``): writes our workload's events to a neutral
  binary record file and drives a child process over JSON lines (stdin / a private reply pipe);
- the peer side (``python benchmarks/_dynamo_peer.py serve`` under Dynamo's interpreter; stdlib and
  ``dynamo._core`` only): reads those files, converts them to Dynamo's JSON ``KvCacheEvent`` form
  and times ``RadixTree.apply_event`` / ``find_matches`` in its own process.

The conversion, the same in every run:

- Dynamo's tree has no tiers, so each (pod, tier) of ours is one Dynamo worker:
  ``worker_id = 2 * pod + tier`` (GPU 0, CPU 1). One (block, pod, tier) entry of ours is one
  (block, worker) of Dynamo's.
- ``BlockStored(hashes, parent, tokens)`` -> ``{"event_id", "data": {"stored": {"parent_hash",
  "blocks": [{"block_hash": engine hash, "tokens_hash": L}]}}}`` with L Dynamo's own
  ``compute_block_hash_for_seq`` of the block's 16 tokens; an event without tokens (an offload)
  takes L from the engine hash's stored event that had them (the join our router makes with its
  learned map). ``BlockRemoved(hashes)`` -> ``{"removed": {"block_hashes": hashes}}``. One JSON
  event per ``apply_event`` call, built before the timed loop (Dynamo's cost of hashing tokens on
  ingest is therefore not counted: in favour of the peer).
- A prompt is scored as ``find_matches(compute_block_hash_for_seq(tokens, 16))`` (ours also starts
  from token ids); ``find_matches`` alone is reported too.
"""

from __future__ import annotations

import array
import json
import os
import struct
import subprocess
import sys

BS = 16
_HDR = struct.Struct("<BIBQI")  # kind, worker, has_parent, parent, n hashes
_TOKENS, _STORED, _REMOVED = 0, 1, 2  # a token table (n hashes, then n * 16 u32 tokens); events
TIERS = {"GPU": 0, "CPU": 1}


# ----------------------------------------------------------------------------- our side

def find_python(flag: str | None) -> str | None:
    """The peer's interpreter: ``--dynamo-python``, else ``$KVEVENTS_DYNAMO_PY``, else
    ``<checkout>/../peers/dynamo/bin/python`` (``setup-routers.sh DIR`` makes ``DIR/dynamo``)."""
    if flag:
        return flag
    if os.environ.get("KVEVENTS_DYNAMO_PY"):
        return os.environ["KVEVENTS_DYNAMO_PY"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cand = os.path.join(os.path.dirname(root), "peers", "dynamo", "bin", "python")
    return cand if os.path.exists(cand) else None


class Feed:
    """Our events as records for the peer: ``add(pod, batch)`` with pod an index."""

    def __init__(self, path: str) -> None:
        self.path, self._f, self._seen = path, open(path, "wb"), set()
        self.events = 0

    def add(self, pod: int, batch) -> None:
        w = self._f.write
        for ev in batch.events:
            name = type(ev).__name__
            hashes = [int(h) for h in ev.block_hashes]
            if name == "BlockStored":
                worker = 2 * pod + TIERS[ev.medium or "GPU"]
                if ev.token_ids and not all(h in self._seen for h in hashes):
                    if len(ev.token_ids) != len(hashes) * BS:
                        raise ValueError(f"event with {len(ev.token_ids)} tokens for {len(hashes)} blocks")
                    w(_HDR.pack(_TOKENS, 0, 0, 0, len(hashes)))
                    w(array.array("Q", hashes).tobytes())
                    w(array.array("I", ev.token_ids).tobytes())
                    self._seen.update(hashes)
                parent = ev.parent_block_hash
                w(_HDR.pack(_STORED, worker, parent is not None, 0 if parent is None else int(parent), len(hashes)))
            elif name == "BlockRemoved":
                w(_HDR.pack(_REMOVED, 2 * pod + TIERS[ev.medium or "GPU"], 0, 0, len(hashes)))
            else:
                raise ValueError(f"no Dynamo form for {name}")
            w(array.array("Q", hashes).tobytes())
            self.events += 1

    def close(self) -> str:
        self._f.close()
        self._seen = set()
        return self.path


def write_prompts(path: str, prompts) -> str:
    with open(path, "wb") as f:
        for p in prompts:
            f.write(struct.pack("<I", len(p)))
            f.write(array.array("I", p).tobytes())
    return path


class PeerError(RuntimeError):
    pass


class DynamoPeer:
    """The child process; ``call(op, **args)`` sends one command and returns its reply."""

    def __init__(self, python: str) -> None:
        self.python = python
        rfd, wfd = os.pipe()
        self._proc = subprocess.Popen([python, os.path.abspath(__file__), "serve", str(wfd)],
                                      stdin=subprocess.PIPE, text=True, pass_fds=(wfd,))
        os.close(wfd)
        self._replies = os.fdopen(rfd, "r")
        self.hello = self._read()

    def _read(self) -> dict:
        line = self._replies.readline()
        if not line:
            raise PeerError(f"the Dynamo peer exited (rc {self._proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(reply["error"])
        return reply

    def call(self, op: str, **args) -> dict:
        self._proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.call("quit")
            except (PeerError, BrokenPipeError):
                pass
        self._proc.wait(timeout=30)
        self._replies.close()


# ----------------------------------------------------------------------------- the peer's side

def _records(data: bytes):
    off, end = 0, len(data)
    while off < end:
        kind, worker, has_parent, parent, n = _HDR.unpack_from(data, off)
        off += _HDR.size
        hashes = array.array("Q", data[off:off + 8 * n]).tolist()
        off += 8 * n
        if kind == _TOKENS:
            tokens = array.array("I", data[off:off + 4 * BS * n]).tolist()
            off += 4 * BS * n
            yield kind, worker, None, hashes, tokens
        else:
            yield kind, worker, (parent if has_parent else None), hashes, None


def rss(trim: bool = False) -> int:
    """This process's resident bytes; ``trim`` first hands glibc's free pages back to the OS
    (``malloc_trim``, every arena), so that growth measured from here is not memory reused."""
    if trim:
        import ctypes

        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _heap_in_use() -> int:
    """glibc's bytes in use over every arena (the tree grows in its own thread's arena, which
    glibc's ``mallinfo`` does not cover): ``malloc_info``'s current system bytes less its free
    chunks, plus mmapped chunks."""
    import ctypes
    import re
    import tempfile

    libc = ctypes.CDLL(None)
    libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        if not fp or libc.malloc_info(0, fp) != 0:
            raise OSError("malloc_info failed")
        libc.fclose(fp)
        xml = open(f.name).read()
    top = xml[xml.rindex("</heap>"):]
    got = {k: int(v) for k, v in re.findall(r'<(?:total|system) type="(\w+)"(?: count="\d+")? size="(\d+)"', top)}
    return got["current"] - got["fast"] - got["rest"] + got["mmap"]


class _Server:
    def __init__(self) -> None:
        import dynamo._core as core  # the peer's interpreter only

        self.core, self.local, self.sets, self.prompts, self.tree = core, {}, {}, [], None
        self.event_ids: dict[int, int] = {}

    def _event(self, kind, worker, parent, hashes) -> bytes:
        eid = self.event_ids.get(worker, 0)
        self.event_ids[worker] = eid + 1
        if kind == _STORED:
            local = self.local
            data = {"stored": {"parent_hash": parent,
                               "blocks": [{"block_hash": h, "tokens_hash": local[h]} for h in hashes]}}
        else:
            data = {"removed": {"block_hashes": hashes}}
        return json.dumps({"event_id": eid, "data": data}, separators=(",", ":")).encode()

    def _learn(self, hashes, tokens) -> None:
        self.local.update(zip(hashes, self.core.compute_block_hash_for_seq(tokens, BS)))

    def _convert(self, path: str):
        with open(path, "rb") as f:
            data = f.read()
        out = []
        for kind, worker, parent, hashes, tokens in _records(data):
            if kind == _TOKENS:
                self._learn(hashes, tokens)
            else:
                out.append((worker, self._event(kind, worker, parent, hashes)))
        return out

    def _apply(self, tree, events) -> None:
        apply = tree.apply_event
        for worker, ev in events:
            apply(worker, ev)
        tree.find_matches([0])  # a round trip through the tree's thread: every event applied

    def op_load(self, name: str, path: str) -> dict:
        self.sets[name] = self._convert(path)
        return {"events": len(self.sets[name])}

    def op_ingest(self, name: str, base: str | None = None) -> dict:
        import gc
        import time

        tree = self.core.RadixTree()
        if base:
            self._apply(tree, self.sets[base])
        gc.collect()
        c, t = time.process_time(), time.perf_counter()
        self._apply(tree, self.sets[name])
        cpu, wall = time.process_time() - c, time.perf_counter() - t
        del tree
        return {"cpu": cpu, "wall": wall, "events": len(self.sets[name])}

    def op_build(self, path: str) -> dict:
        """The score index, built from the records: the token tables learned first, then RSS
        measured around the tree's growth while the events are converted and applied one by one."""
        import gc
        import time

        with open(path, "rb") as f:
            data = f.read()
        for kind, _w, _p, hashes, tokens in _records(data):
            if kind == _TOKENS:
                self._learn(hashes, tokens)
        self.tree = None
        gc.collect()
        before, heap0 = rss(trim=True), _heap_in_use()
        c = time.process_time()
        tree, n = self.core.RadixTree(), 0
        for kind, worker, parent, hashes, _t in _records(data):
            if kind != _TOKENS:
                tree.apply_event(worker, self._event(kind, worker, parent, hashes))
                n += 1
        tree.find_matches([0])
        cpu = time.process_time() - c
        gc.collect()
        out = {"events": n, "cpu": cpu, "rss_delta": rss() - before, "heap_delta": _heap_in_use() - heap0}
        self.tree, self.local = tree, {}  # the map was learned before the first reading: freed after the last
        return out

    def op_prompts(self, path: str) -> dict:
        with open(path, "rb") as f:
            data = f.read()
        off, self.prompts = 0, []
        while off < len(data):
            (n,) = struct.unpack_from("<I", data, off)
            self.prompts.append(array.array("I", data[off + 4:off + 4 + 4 * n]).tolist())
            off += 4 + 4 * n
        return {"prompts": len(self.prompts)}

    def op_score(self, start: int, stop: int, repeat: int = 3) -> dict:
        """Per prompt, the best of ``repeat`` (as ours): hash + find_matches, and find_matches alone."""
        import time

        hash_seq, find, clock = self.core.compute_block_hash_for_seq, self.tree.find_matches, time.perf_counter
        full, alone = [], []
        for prompt in self.prompts[start:stop]:
            b1 = b2 = float("inf")
            for _ in range(repeat):
                t = clock()
                find(hash_seq(prompt, BS))
                b1 = min(b1, clock() - t)
            seq = hash_seq(prompt, BS)
            for _ in range(repeat):
                t = clock()
                find(seq)
                b2 = min(b2, clock() - t)
            full.append(b1)
            alone.append(b2)
        return {"full": full, "find": alone}

    def op_matches(self, indices: list[int]) -> dict:
        out = []
        for i in indices:
            scores = self.tree.find_matches(self.core.compute_block_hash_for_seq(self.prompts[i], BS)).scores
            out.append([[w, r, n] for (w, r), n in scores.items()])
        return {"matches": out}


def serve(reply_fd: int) -> None:
    replies = os.fdopen(reply_fd, "w")
    os.dup2(2, 1)  # anything the library prints goes to stderr, never into the replies

    def say(obj) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    try:
        server = _Server()
        from importlib.metadata import PackageNotFoundError, version
        try:
            ver = version("ai-dynamo-runtime")
        except PackageNotFoundError:
            ver = "?"
        say({"ready": True, "version": ver})
    except Exception as e:  # noqa: BLE001  (the reason goes back to the parent's table)
        say({"error": f"{type(e).__name__}: {e}"})
        return
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            say({"bye": True})
            return
        try:
            say(getattr(server, f"op_{op}")(**cmd))
        except Exception as e:  # noqa: BLE001
            say({"error": f"{op}: {type(e).__name__}: {e}"})


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        sys.exit("usage: (run by benchmarks/router.py) _dynamo_peer.py serve REPLY_FD")
