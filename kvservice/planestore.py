"""The replicas' shared state on JetStream: snapshots in an object store bucket, each replica's
covered stream seq and the purge lease in a key-value bucket.

* ``snapshots`` (object store): one object per replica, ``<replica>``, its latest snapshot as a
  checksummed envelope (:func:`seal`): the stream's identity (name, creation time, the config
  that gives its seqs their meaning), the stream seq covered, the event source's per-pod
  positions (run, seq, topic) and the router's snapshot, with a SHA-256 over all of it. A
  starting replica trusts nothing outside it: the object's description (``{"stream_seq": N}``)
  only orders the candidates, so it picks the newest without downloading the others. A snapshot
  of another stream (deleted and re-created), of another stream config, with positions that do
  not agree with the stream, or damaged, is refused (:class:`SnapshotRefused`, its reason named).
* ``replicas`` (key-value, entries expire after ``ttl`` seconds): ``cover.<replica>`` = the
  stream seq that replica's saved snapshot covers (it re-puts it every heartbeat, so a dead
  replica's entry disappears after ``ttl``); ``purge-lease`` = who purges now (``create`` only
  succeeds when the key is absent, and the lease expires with the bucket's ``ttl`` if its
  holder dies).

Purging: the lease holder removes stream messages up to the LOWEST seq every live replica
covers. A replica publishes its cover (the snapshot it loaded, or 0) before it reads a
message, so a live replica's unread messages are never purged; and each subject's purge stops at
one of its own messages below that floor, so nats-server moves no consumer past a message it
has not read (``purge_below``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import time

from kvevents.errors import KVEventsError

__all__ = ["PlaneStore", "SnapshotRefused", "open_envelope", "seal", "stream_identity"]

MAGIC = b"KVPLANE1"
_HLEN = struct.Struct(">I")


def stream_identity(name: str, subjects: list[str], created) -> dict:
    """What a snapshot's seqs are seqs OF: the stream (its name and creation time: a stream
    deleted and re-created under the same name is another stream) and its config (the subjects
    it holds)."""
    config = hashlib.sha256(json.dumps({"name": name, "subjects": sorted(subjects)}).encode()).hexdigest()[:16]
    return {"stream": name, "created": str(created), "config": config}


def seal(identity: dict, stream_seq: int, pods: dict, router_snapshot: bytes) -> bytes:
    """The snapshot object: MAGIC, a header (identity, covered seq, positions), the router's
    snapshot, and a SHA-256 of everything before it."""
    head = json.dumps({**identity, "stream_seq": stream_seq,
                       "pods": {p: [int(v[0]), int(v[1]), str(v[2])] for p, v in pods.items()}}).encode()
    body = b"".join((MAGIC, _HLEN.pack(len(head)), head, router_snapshot))
    return body + hashlib.sha256(body).digest()


def open_envelope(data: bytes, identity: dict, last_seq: int) -> tuple[bytes, int, dict[str, tuple]]:
    """(router snapshot, stream seq, per-pod positions) of a sealed snapshot, checked against the
    stream it is meant for (``identity``; ``last_seq``: the stream's last seq now); a
    :class:`SnapshotRefused` names why not."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HLEN.size + 32:
        raise SnapshotRefused("format", "not a sealed event-plane snapshot (an older format, or another object)")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise SnapshotRefused("checksum", "its checksum does not match its bytes (damaged)")
    n = _HLEN.unpack_from(body, len(MAGIC))[0]
    start = len(MAGIC) + _HLEN.size
    try:
        head = json.loads(body[start:start + n])
        seq = head["stream_seq"]
        pods = {str(p): (v[0], v[1], v[2]) for p, v in head["pods"].items()}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise SnapshotRefused("positions", f"its header cannot be read ({exc})") from None
    if head.get("stream") != identity["stream"] or head.get("created") != identity["created"]:
        raise SnapshotRefused("another-stream", f"it covers stream {head.get('stream')!r} created "
                                                f"{head.get('created')}, not the one created {identity['created']}")
    if head.get("config") != identity["config"]:
        raise SnapshotRefused("another-config", f"it covers stream config {head.get('config')}, "
                                                f"the stream's is {identity['config']}")
    ok = type(seq) is int and 0 <= seq <= last_seq and all(
        type(r) is int and type(q) is int and type(t) is str and r >= 0 and q >= -1 for r, q, t in pods.values())
    if not ok:
        raise SnapshotRefused("positions", f"its positions do not fit the stream (seq {seq!r}, stream's last "
                                           f"{last_seq}, {len(pods)} pods)")
    return body[start + n:], seq, pods

LEASE = "purge-lease"


class PlaneStore:
    """Coroutines run on the caller's nats-py loop (``js`` is a JetStreamContext)."""

    def __init__(self, js, *, stream: str = "KVEVENTS", snapshots: str = "kvrouter-snapshots",
                 replicas: str = "kvrouter-replicas", ttl: float = 5.0, storage: str = "file") -> None:
        self.js = js
        self.stream = stream
        self.snapshots_bucket = snapshots
        self.replicas_bucket = replicas
        self.ttl = ttl
        self.storage = storage
        self.obs = None
        self.kv = None
        self.reads_replaced = 0  #: snapshot reads that met a newer save and read that one
        self._purged_to = 0  #: the cut of this store's previous purge (where the next looks for each subject's first message)

    async def open(self) -> None:
        from nats.js import api
        from nats.js.errors import BucketNotFoundError, NotFoundError

        st = api.StorageType.FILE if self.storage == "file" else api.StorageType.MEMORY

        async def open_or_create(get, create):
            try:
                return await get()
            except (BucketNotFoundError, NotFoundError):
                pass
            try:
                return await create()
            except Exception:  # another replica created it first
                return await get()
        self.obs = await open_or_create(lambda: self.js.object_store(self.snapshots_bucket),
                                        lambda: self.js.create_object_store(self.snapshots_bucket, storage=st))
        kv_cfg = api.KeyValueConfig(bucket=self.replicas_bucket, ttl=self.ttl, storage=st, history=1)
        self.kv = await open_or_create(lambda: self.js.key_value(self.replicas_bucket),
                                       lambda: self.js.create_key_value(kv_cfg))

    # ---- snapshots ------------------------------------------------------------------------------

    async def identity(self) -> dict:
        """The stream's identity now (see :func:`stream_identity`)."""
        info = await self.js.stream_info(self.stream)
        return stream_identity(self.stream, list(info.config.subjects or []), info.created)

    async def save(self, replica: str, data: bytes, stream_seq: int, pods: dict | None = None,
                   identity: dict | None = None) -> None:
        """Save the router snapshot ``data`` sealed with what it covers (``identity``: the stream's,
        read now if not given)."""
        from nats.js import api

        sealed = seal(identity or await self.identity(), stream_seq, pods or {}, data)
        desc = json.dumps({"stream_seq": stream_seq, "bytes": len(sealed), "saved_at": time.time()})
        await self.obs.put(replica, sealed, meta=api.ObjectMeta(name=replica, description=desc))

    async def candidates(self) -> list[tuple[int, str]]:
        """Saved snapshots as (stream_seq, object name), newest first.

        Read from the bucket's stream state (one meta subject per object, and its last message),
        not with nats-py's ``list()``: that walks a watcher which, while replicas save their
        snapshots, hangs (7 of 289 calls did not end within 3 s in a stress run) or lists an
        object twice or not at all."""
        from nats.js.errors import NotFoundError

        stream = f"OBJ_{self.snapshots_bucket}"
        prefix = f"$O.{self.snapshots_bucket}.M."
        info = await self.js.stream_info(stream, subjects_filter=f"{prefix}>")
        out = []
        for subject in (info.state.subjects or {}):
            try:
                msg = await self.js.get_last_msg(stream, subject)
            except NotFoundError:
                continue  # removed since the listing
            try:
                name = base64.urlsafe_b64decode(subject[len(prefix):] + "==").decode()
            except (ValueError, UnicodeDecodeError):
                continue  # not a name this store wrote
            try:
                meta = json.loads(msg.data)
                if meta.get("deleted"):
                    continue
                seq = int(json.loads(meta.get("description") or "{}").get("stream_seq", -1))
            except (ValueError, TypeError, AttributeError):
                seq = -1  # a foreign or damaged description: tried last
            out.append((seq, name))
        out.sort(reverse=True)
        return out

    async def load(self, name: str, identity: dict | None = None) -> tuple[bytes, int, dict[str, tuple]]:
        """(router snapshot, stream seq, per-pod positions) of a saved snapshot, checked against the
        stream (``identity``, read now if not given); :class:`SnapshotRefused` names why not."""
        data, _ = await self.read(name)
        identity = identity or await self.identity()
        last = (await self.js.stream_info(self.stream)).state.last_seq
        return open_envelope(data, identity, last)

    CHUNK_POLL = 0.25  #: seconds without a chunk before a read checks whether the object was replaced
    CHUNK_WAIT = 5.0  #: seconds without a chunk (the object unchanged) before the read fails

    async def read(self, name: str):
        """One object's bytes and info, read chunk by chunk, checked against its size and digest.

        A replica re-saves its object every few seconds, and a save purges the previous version's
        chunks once the new meta is in: a reader that fetched the old meta then finds no chunks
        and would wait for ever (nats-py's own ``get`` does). Here a read that sees no chunk for
        ``CHUNK_POLL`` seconds looks at the meta again: replaced -> read the new version (counted
        in ``reads_replaced``); unchanged for ``CHUNK_WAIT`` -> a SnapshotLoadError naming what
        was missing."""
        from nats.errors import TimeoutError as NatsTimeout

        for _ in range(10):
            info = await self.obs.get_info(name)
            if not info.nuid:
                raise SnapshotLoadError(f"snapshot {name!r}: its meta names no data")
            if not info.size:
                return b"", info
            sub = await self.js.subscribe(f"$O.{self.snapshots_bucket}.C.{info.nuid}", stream=f"OBJ_{self.snapshots_bucket}",
                                          ordered_consumer=True)
            parts: list[bytes] = []
            got, done, waited, replaced = 0, False, 0.0, False
            try:
                while not done:
                    try:
                        msg = await sub.next_msg(timeout=self.CHUNK_POLL)
                    except NatsTimeout:
                        now = await self.obs.get_info(name)
                        if now.nuid != info.nuid:
                            replaced = True
                            break
                        waited += self.CHUNK_POLL
                        if waited >= self.CHUNK_WAIT:
                            raise SnapshotLoadError(
                                f"snapshot {name!r}: no chunk for {self.CHUNK_WAIT:g} s after {got} of {info.size} "
                                f"bytes (its chunks are missing from the bucket)") from None
                        continue
                    parts.append(msg.data)
                    got += len(msg.data)
                    done = msg.metadata.num_pending == 0
            finally:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass  # the connection went: nothing left to stop
            if replaced:
                self.reads_replaced += 1  # saved again while we read: read the new version
                continue
            data = b"".join(parts)
            want = (info.digest or "").split("=", 1)[-1].rstrip("=")
            have = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")
            if len(data) != info.size or want != have:
                raise SnapshotLoadError(f"snapshot {name!r}: read {len(data)} of {info.size} bytes, "
                                        f"digest {'matches' if want == have else 'differs'}")
            return data, info
        raise SnapshotLoadError(f"snapshot {name!r}: saved again 10 times while being read")

    # ---- covered seqs and the purge lease --------------------------------------------------------

    async def cover(self, replica: str, stream_seq: int) -> None:
        await self.kv.put(f"cover.{replica}", json.dumps({"seq": stream_seq, "ts": time.time()}).encode())

    async def covers(self) -> dict[str, int]:
        """Every live replica's covered seq (entries past their ttl are gone).

        Read from the bucket's stream state, not with nats-py's ``kv.keys()``: that walks a
        last-per-subject consumer and, while other replicas re-put their covers (every
        heartbeat), it returns keys twice and leaves others out — a purge floor computed without a
        live replica's cover would purge messages that replica has not read. The stream state
        lists every subject that holds a message; a cover whose message expires between the two
        reads is a dead replica's. Any other failure raises: no floor, no purge."""
        from nats.js.errors import NotFoundError

        prefix = f"$KV.{self.replicas_bucket}."
        stream = f"KV_{self.replicas_bucket}"
        info = await self.js.stream_info(stream, subjects_filter=f"{prefix}cover.>")
        out = {}
        for subject in (info.state.subjects or {}):
            try:
                msg = await self.js.get_last_msg(stream, subject)
            except NotFoundError:
                continue  # expired since the listing: that replica stopped heartbeating
            if msg.headers and msg.headers.get("KV-Operation") in ("DEL", "PURGE"):
                continue
            try:
                out[subject[len(prefix) + 6:]] = int(json.loads(msg.data)["seq"])
            except (ValueError, TypeError, KeyError) as exc:
                raise KVEventsError(f"cover {subject!r} is not a cover ({exc}): not purging") from None
        return out

    async def purge_below(self, cut: int) -> int:
        """Remove the messages below ``cut``, subject by subject, so that no consumer reading at
        ``cut`` or later is moved: returns how many messages went.

        Each subject keeps its LAST message below ``cut`` (a bridge or publisher that restarts
        reads its pod's last (run, seq) from the stream, and a purged pod history would look like
        a new pod). Why not purge each subject up to ``cut``: nats-server (2.9.10 here) moves
        every consumer that reads the subject to the purged subject's first remaining message,
        so a consumer at ``cut`` -- a replica that has just started from its snapshot -- would
        skip every other subject's messages up to that subject's next one (seen: a replica lost
        2-4 messages in 2 of 12 plane demos on a loaded machine). A subject's purge stops at one
        of its own messages below ``cut``: the first it published since the previous purge this
        store did (its last one, for a subject that published nothing since), so what is left
        below ``cut`` is at most one purge interval of messages per subject."""
        from nats.js.errors import NotFoundError

        info = await self.js.stream_info(self.stream, subjects_filter=">")
        before = info.state.messages
        if info.state.first_seq >= cut:
            return 0
        since = max(self._purged_to, info.state.first_seq)
        for subject in (info.state.subjects or {}):
            last = (await self.js.get_last_msg(self.stream, subject)).seq
            if last < cut:
                upto = last
            else:
                try:
                    upto = (await self.js.get_msg(self.stream, seq=since, subject=subject, next=True)).seq
                except NotFoundError:
                    continue
                if upto >= cut:
                    continue  # nothing of this subject between the previous purge and cut: next time
            if upto > info.state.first_seq:
                await self.js.purge_stream(self.stream, seq=upto, subject=subject)  # seqs < upto
        self._purged_to = max(self._purged_to, cut)
        after = (await self.js.stream_info(self.stream)).state.messages
        return max(0, before - after)

    async def try_purge(self, replica: str) -> int:
        """If the lease is free, take it and purge the stream up to the lowest covered seq.
        Returns how many messages were purged (0 if another replica holds the lease)."""
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            rev = await self.kv.create(LEASE, replica.encode())
        except KeyWrongLastSequenceError:
            return 0
        try:
            covers = await self.covers()
            if not covers or replica not in covers:
                return 0
            floor = min(covers.values())
            if floor <= 0:
                return 0
            return await self.purge_below(floor + 1)
        finally:
            try:
                await self.kv.delete(LEASE, last=rev)
            except Exception:
                pass  # expires with the bucket's ttl


class SnapshotLoadError(KVEventsError):
    """No saved snapshot could be restored (each failure is named)."""


class SnapshotRefused(KVEventsError):
    """A snapshot that reads back whole but does not belong here: ``reason`` is one of
    ``format``, ``checksum``, ``another-stream``, ``another-config``, ``positions``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
