"""Pod states over real HTTP with real publishers: liveness from evidence, never from silence;
configured pods routable before they publish; restarts and gaps in /v1/pods (docs/pod-states.md)."""

from __future__ import annotations

import re
import time

import pytest
import zmq

from kvevents import AllBlocksCleared, KVEventBatch, ZmqEventPublisher, encode_batch
from kvservice.config import from_dict

from .service_helpers import MODEL, InProcessService, stored, wait_for

TOKS = list(range(2000, 2064))  # 4 blocks of 16


def _service(tmp_path, pods: list[dict], **sub) -> InProcessService:
    cfg = from_dict({"router": {"model": MODEL}, "api": {"port": 0},
                     "subscriber": {"late_join": False, **sub}, "pods": pods}).validate()
    return InProcessService(cfg)


def _pod(http, name: str) -> dict:
    return next(p for p in http.get("/v1/pods")[1]["pods"] if p["name"] == name)


def test_a_pod_silent_past_every_timeout_is_picked_with_its_full_score(tmp_path):
    """vLLM publishes nothing while idle: a pod whose connection is up (and whose replay socket
    answers its idle probes) stays SYNCED and keeps its full weight however long it is quiet."""
    pubs = {"a": ZmqEventPublisher(f"ipc://{tmp_path}/a.pub", f"ipc://{tmp_path}/a.replay", topic=""),
            "b": ZmqEventPublisher(f"ipc://{tmp_path}/b.pub", None, topic="")}  # no replay endpoint
    pods = [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub", "replay_endpoint": f"ipc://{tmp_path}/a.replay"},
            {"name": "b", "endpoint": f"ipc://{tmp_path}/b.pub"}]
    stale, replay = 0.2, 0.1
    svc = _service(tmp_path, pods, stale_after=stale, replay_timeout=replay)
    try:
        http = svc.http
        for i, name in enumerate(("a", "b")):
            toks = [t + 100 * i for t in TOKS]

            def indexed(name=name, toks=toks):
                pubs[name].publish(stored(toks, [10 * i + k for k in range(4)]))
                top = http.post("/v1/score", {"model": MODEL, "token_ids": toks})[1]["pods"][0]
                return top["pod"] == name and top["total"] == 1.0

            wait_for(indexed, what=f"{name}'s first batch indexed")
        # quiet now for longer than every timeout: stale_after, and twice it plus the replay timeout
        quiet = 2 * stale + replay
        wait_for(lambda: all((_pod(http, n)["last_recv_age_s"] or 0) > 3 * quiet for n in "ab"), timeout=30,
                 what="both pods quiet past every timeout")
        for i, name in enumerate(("a", "b")):
            status, body = http.post("/v1/score", {"model": MODEL, "token_ids": [t + 100 * i for t in TOKS]})
            assert status == 200 and body["pick"] == name
            top = body["pods"][0]
            assert (top["pod"], top["state"], top["factor"], top["total"]) == (name, "SYNCED", 1.0, 1.0)
            p = _pod(http, name)
            assert p["state"] == "SYNCED" and p["connected"] is True and p["state_changes"] == 0
        assert http.get("/readyz")[0] == 200
    finally:
        svc.close()
        for p in pubs.values():
            p.shutdown(timeout=0.5)


def test_a_pod_without_a_replay_endpoint_is_ready_and_ranked_without_traffic(tmp_path):
    """vLLM's default events config (no replay endpoint): ready once subscribed, ranked by /v1/score
    (with what it has told: nothing yet, a total of 0.0, never -0.0) before it ever publishes."""
    pub = ZmqEventPublisher(f"ipc://{tmp_path}/a.pub", None, topic="")
    svc = _service(tmp_path, [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub"}])
    try:
        http = svc.http
        wait_for(lambda: http.get("/readyz")[0] == 200, what="/readyz with no traffic")
        status, _h, raw = http.call("POST", "/v1/score", {"model": MODEL, "token_ids": TOKS})
        assert status == 200 and b"-0.0" not in raw
        import json

        body = json.loads(raw)
        assert body["pick"] == "a" and [(p["pod"], p["total"], p["state"]) for p in body["pods"]] == \
            [("a", 0.0, "SYNCED")]
        p = _pod(http, "a")
        assert p["state"] == "SYNCED" and p["batches"] == 0 and p["last_seq"] == -1
    finally:
        svc.close()
        pub.shutdown(timeout=0.5)


def test_a_publisher_restart_shows_the_new_runs_last_seq_one_reset_and_every_batch(tmp_path):
    pub_ep, rep_ep = f"ipc://{tmp_path}/a.pub", f"ipc://{tmp_path}/a.replay"
    pub = ZmqEventPublisher(pub_ep, rep_ep, topic="")
    for i in range(3):  # before the service starts: only its start-up replay brings these
        pub.publish(stored(TOKS, [100 + i]))
    cfg = from_dict({"router": {"model": MODEL}, "api": {"port": 0}, "subscriber": {"late_join": True},
                     "pods": [{"name": "a", "endpoint": pub_ep, "replay_endpoint": rep_ep}]}).validate()
    svc = InProcessService(cfg)
    try:
        http = svc.http
        wait_for(lambda: _pod(http, "a")["batches"] == 3, what="the start-up replay's batches counted")
        assert _pod(http, "a")["last_seq"] == 2

        def live(n):
            def pred():
                pub.publish(stored(TOKS, [200 + pred.k]))
                pred.k += 1
                return _pod(http, "a")["last_seq"] >= n
            pred.k = 0
            return pred

        wait_for(live(9), what="the first run past seq 9")
        last = pub.next_seq - 1  # every batch of the first run, delivered
        wait_for(lambda: _pod(http, "a")["last_seq"] == last, what="the first run's last batch")
        first_run = _pod(http, "a")
        assert first_run["resets"] == 0 and first_run["batches"] == first_run["last_seq"] + 1
        pub.shutdown(timeout=0.5)
        pub = ZmqEventPublisher(pub_ep, rep_ep, topic="")  # the restarted engine: seqs from 0 again
        for k in range(3):  # (sent before the router reconnects: its replay from 0 brings them)
            pub.publish(stored(TOKS, [300 + k]))
        wait_for(lambda: _pod(http, "a")["resets"] >= 1 and _pod(http, "a")["last_seq"] == 2, timeout=20,
                 what="the restart seen and the new run's 3 batches applied")
        p = _pod(http, "a")
        assert p["resets"] == 1
        assert p["last_seq"] == 2 < first_run["last_seq"]  # the new run's, not the old run's highest
        assert p["batches"] == first_run["batches"] + 3, (first_run, p)  # every batch of both runs
    finally:
        svc.close()
        pub.shutdown(timeout=0.5)


def test_an_unrecoverable_gap_leaves_the_pod_routable_and_says_so(tmp_path):
    """A publisher without a replay socket skips seqs: the gap is unrecoverable. The pod stays
    routed with its score discounted (state UNRELIABLE, the factor shown), in /v1/pods, /v1/explain
    and the metrics; an AllBlocksCleared from it makes it certain again, its total 0.0, not -0.0."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    ep = f"ipc://{tmp_path}/a.pub"
    sock.bind(ep)
    svc = _service(tmp_path, [{"name": "a", "endpoint": ep}])
    try:
        http = svc.http

        def send(seq, batch):
            sock.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(batch)])

        def first():
            send(0, stored(TOKS, [1, 2, 3, 4]))
            return _pod(http, "a")["batches"] >= 1

        wait_for(first, what="seq 0 applied")
        send(5, stored([t + 1 for t in TOKS], [11, 12, 13, 14]))  # seqs 1..4 lost for good
        wait_for(lambda: _pod(http, "a")["state"] == "UNRELIABLE", what="the gap seen")
        p = _pod(http, "a")
        assert p["unrecoverable"] == 4 and p["uncertainty"] == {"factor": 0.5, "batches_left": 511}
        body = http.post("/v1/score", {"model": MODEL, "token_ids": TOKS})[1]
        assert body["pick"] == "a"
        assert [(s["state"], s["factor"], s["total"]) for s in body["pods"]] == [("UNRELIABLE", 0.5, 0.5)]
        exp = http.post("/v1/explain", {"model": MODEL, "token_ids": TOKS})[1]["pods"]["a"][0]
        assert exp["state"] == "UNRELIABLE" and "discounted x0.5" in exp["reason"]
        text = http.call("GET", "/metrics")[2].decode()
        assert re.search(r"^kvevents_router_uncertain_pods\{[^}]*\} 1\.0$", text, re.M)
        assert re.search(r"^kvevents_router_gaps_total\{[^}]*\} 1\.0$", text, re.M)
        send(6, KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        wait_for(lambda: _pod(http, "a")["state"] == "SYNCED", what="certain again after the clear")
        status, _h, raw = http.call("POST", "/v1/score", {"model": MODEL, "token_ids": TOKS})
        assert status == 200 and b'"total":0.0' in raw and b"-0.0" not in raw
        assert _pod(http, "a")["uncertainty"] is None
    finally:
        svc.close()
        sock.close(0)


def test_an_unreachable_publisher_leaves_routing_and_comes_back_each_flap_counted(tmp_path):
    """Evidence both ways: the publisher's connection lost and nothing else heard for stale_after
    takes the pod out (STALE, factor 0); its publisher back (a connection) brings it in again.
    Each transition and each lost connection is counted."""
    ep = f"ipc://{tmp_path}/a.pub"
    pub = ZmqEventPublisher(ep, None, topic="")
    svc = _service(tmp_path, [{"name": "a", "endpoint": ep}], stale_after=0.2)
    try:
        http = svc.http

        def pods():
            return [p["pod"] for p in http.post("/v1/score", {"model": MODEL, "token_ids": TOKS})[1]["pods"]]

        wait_for(lambda: http.get("/readyz")[0] == 200, what="ready")
        assert pods() == ["a"]
        pub.shutdown(timeout=0.5)
        wait_for(lambda: _pod(http, "a")["state"] == "STALE", what="the pod unreachable")
        p = _pod(http, "a")
        assert p["connected"] is False and p["disconnects"] == 1 and p["state_changes"] == 1
        assert pods() == []  # out on evidence: no connection, nothing heard
        pub = ZmqEventPublisher(ep, None, topic="")
        wait_for(lambda: _pod(http, "a")["state"] == "SYNCED", what="the pod reachable again")
        assert _pod(http, "a")["state_changes"] == 2 and pods() == ["a"]
    finally:
        svc.close()
        pub.shutdown(timeout=0.5)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "x"])
def test_relearn_batches_is_validated_at_start_up_naming_the_key(bad):
    from kvevents.errors import ConfigError

    with pytest.raises(ConfigError, match=r"relearn_batches"):
        from_dict({"router": {"model": MODEL, "relearn_batches": bad},
                   "pods": [{"name": "a", "endpoint": "tcp://127.0.0.1:5999"}]}).validate()


def test_a_pod_on_vllms_default_events_config_gets_its_share_of_cold_requests(tmp_path):
    """Two pods behind the proxy, both publishers up and silent: pod a with a replay endpoint,
    pod b on vLLM's default events config (none). Before either has published, cold prompts
    (nothing cached anywhere) reach both engines: b is ready and routed without traffic."""
    from .test_service_proxy_faults import FakeEngine

    pubs = {"a": ZmqEventPublisher(f"ipc://{tmp_path}/a.pub", f"ipc://{tmp_path}/a.replay", topic=""),
            "b": ZmqEventPublisher(f"ipc://{tmp_path}/b.pub", None, topic="")}
    engines = {"a": FakeEngine("ok"), "b": FakeEngine("ok")}
    cfg = from_dict({"router": {"model": MODEL}, "api": {"port": 0, "proxy": True},
                     "subscriber": {"late_join": False},
                     "pods": [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub",
                               "replay_endpoint": f"ipc://{tmp_path}/a.replay", "http": engines["a"].url},
                              {"name": "b", "endpoint": f"ipc://{tmp_path}/b.pub", "http": engines["b"].url}]})
    svc = InProcessService(cfg.validate())
    try:
        http = svc.http
        wait_for(lambda: http.get("/readyz")[0] == 200, what="both pods ready without traffic")
        for i in range(40):
            status, body = http.post("/v1/completions", {"model": MODEL, "prompt": [5000 + i, 7, 8], "max_tokens": 1})
            assert status == 200, body
        posts = {n: e.posts for n, e in engines.items()}
        assert sum(posts.values()) == 40 and min(posts.values()) >= 5, posts  # spread, never all to one
        assert all(_pod(http, n)["batches"] == 0 for n in "ab")  # neither published a thing
    finally:
        svc.close()
        for p in pubs.values():
            p.shutdown(timeout=0.5)
        for e in engines.values():
            e.close()
