"""The router service's API over real HTTP on loopback, fed by real ZeroMQ publishers."""

from __future__ import annotations

import logging

import pytest

from kvevents import ZmqEventPublisher
from kvevents.errors import ConfigError
from kvservice.config import from_dict

from .service_helpers import MODEL, InProcessService, stored, wait_for


@pytest.fixture
def fleet2(tmp_path):
    """Two publishers on vLLM's default topic "" (with replay sockets), the service in front."""
    pubs = {n: ZmqEventPublisher(f"ipc://{tmp_path}/{n}.pub", f"ipc://{tmp_path}/{n}.replay", topic="")
            for n in ("a", "b")}
    cfg = from_dict({"router": {"model": MODEL}, "api": {"port": 0, "max_body_bytes": 4096},
                     "pods": [{"name": n, "endpoint": f"ipc://{tmp_path}/{n}.pub",
                               "replay_endpoint": f"ipc://{tmp_path}/{n}.replay"} for n in pubs]}).validate()
    svc = InProcessService(cfg)
    try:
        yield svc, pubs
    finally:
        svc.close()
        for p in pubs.values():
            p.shutdown(timeout=0.5)


TOKS = list(range(1000, 1064))  # 4 blocks of 16


def _indexed(http, n: int):
    return lambda: http.get("/v1/pods")[1]["router"]["entries"] >= n


def test_routes_round_trip_on_vllm_default_topic(fleet2) -> None:
    svc, pubs = fleet2
    http = svc.http
    wait_for(lambda: http.get("/readyz")[0] == 200, what="ready")
    assert http.get("/healthz") == (200, {"status": "alive"})
    pubs["a"].publish(stored(TOKS, [1, 2, 3, 4]))
    pubs["b"].publish(stored(TOKS[:32], [11, 12]))
    wait_for(_indexed(http, 6), what="6 entries")
    status, body = http.post("/v1/score", {"model": MODEL, "token_ids": TOKS})
    assert status == 200
    assert body["pick"] == "a" and body["prompt_tokens"] == 64
    by_pod = {p["pod"]: p for p in body["pods"]}
    assert by_pod["a"]["tokens_by_tier"] == {"GPU": 64} and by_pod["b"]["tokens_by_tier"] == {"GPU": 32}
    assert by_pod["a"]["state"] == "SYNCED" and by_pod["a"]["total"] > by_pod["b"]["total"]
    # model may be left out: the fleet serves one
    assert http.post("/v1/pick", {"token_ids": TOKS}) == (200, {"model": MODEL, "pick": "a", "prompt_tokens": 64})
    status, body = http.post("/v1/explain", {"model": MODEL, "token_ids": TOKS})
    assert status == 200 and body["pods"]["b"][0]["matched_tokens"] == 32
    assert "block 2" in body["pods"]["b"][0]["reason"]
    # the pod table follows subscriber health a few times a second
    pods = wait_for(lambda: (p := http.get("/v1/pods")[1])["pods"][0]["last_seq"] == 0 and p, what="pod table")
    assert pods["ready"] is True and pods["unattributed"] == []
    assert pods["router"]["entries_by_tier"]["GPU"] == 6
    # per pod: each pod's own holdings (a: 4 blocks, b: 2), over real HTTP
    # (the per-pod counts may be up to api.pods_cache_s old while batches arrive: wait for both pods)
    def per_pod():
        p = http.get("/v1/pods")[1]
        return [q.get("entries_by_tier", {}).get("GPU") for q in p["pods"]] == [4, 2] and p

    pods = wait_for(per_pod, what="per-pod entries")
    by_name = {p["name"]: p["entries_by_tier"] for p in pods["pods"]}
    assert by_name["a"]["GPU"] == 4 and by_name["b"]["GPU"] == 2
    a = next(p for p in pods["pods"] if p["name"] == "a")
    assert a["state"] == "SYNCED" and a["last_seq"] == 0 and a["batches"] == 1 and a["lag_s"] is not None
    status, headers, text = http.call("GET", "/metrics")
    assert status == 200
    text = text.decode()
    assert "kvevents_router_batches" in text  # the project's OpenTelemetry metrics
    assert 'kvservice_http_requests_total{route="/v1/score",method="POST",status="200"} 1' in text
    assert 'kvservice_http_request_duration_seconds_count{route="/v1/score"} 1' in text
    assert "kvservice_ready 1" in text
    status, doc = http.get("/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.") and "/v1/score" in doc["paths"]


@pytest.mark.parametrize("body,status,field", [
    ({"model": MODEL, "token_ids": "abc"}, 400, "token_ids"),
    ({"model": MODEL, "token_ids": [1, "x"]}, 400, "token_ids[1]"),
    ({"model": MODEL, "token_ids": []}, 400, "token_ids"),
    ({"model": MODEL, "token_ids": [-1]}, 400, "token_ids[0]"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL}, 400, "token_ids"),
    ({"model": MODEL, "token_ids": [1], "prompt": "x"}, 400, "prompt"),
    ({"model": "other", "token_ids": [1]}, 404, "model"),
    ({"model": 7, "token_ids": [1]}, 400, "model"),
    ({"model": MODEL, "token_ids": [1], "colour": "red"}, 400, "colour"),
    ({"model": MODEL, "prompt": "hello"}, 400, "prompt"),  # no tokenizer configured
    ([1, 2], 400, None),
])
def test_bad_input_is_a_4xx_naming_the_field(fleet2, body, status, field) -> None:
    http = fleet2[0].http
    for route in ("/v1/score", "/v1/pick", "/v1/explain"):
        got, err = http.post(route, body)
        assert got == status, (route, err)
        assert err["error"]["field"] == field and err["error"]["status"] == status


def test_transport_level_errors_are_json(fleet2) -> None:
    http = fleet2[0].http
    status, _h, data = http.call("POST", "/v1/score", raw=b"{not json")
    assert status == 400 and b"not valid JSON" in data
    status, _h, data = http.call("POST", "/v1/score", raw=b"")
    assert status == 400 and b"empty" in data
    status, _h, data = http.call("POST", "/v1/score", raw=b'{"token_ids": [' + b"1," * 5000 + b"1]}")
    assert status == 413 and b"over the limit of 4096 bytes" in data
    status, _h, data = http.call("POST", "/v1/score", raw=b"{}", headers={"content-type": "text/plain"})
    assert status == 415 and b"content-type" in data
    assert http.get("/v1/nothing")[0] == 404
    status, err = http.json("GET", "/v1/score")
    assert status == 405 and err["error"]["type"] == "http_error"
    status, _h, text = http.call("GET", "/metrics")
    assert b'status="413"' in text and b"kvservice_internal_errors_total 0" in text


def test_bearer_token_required(tmp_path) -> None:
    pub = ZmqEventPublisher(f"ipc://{tmp_path}/a.pub", None, topic="")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    cfg = from_dict({"router": {"model": MODEL}, "api": {"port": 0, "api_token_file": str(token_file)},
                     "pods": [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub"}]}).validate()
    svc = InProcessService(cfg)
    try:
        http = svc.http
        status, err = http.post("/v1/score", {"token_ids": [1]})
        assert status == 401 and err["error"]["field"] == "Authorization"
        assert http.call("GET", "/v1/pods")[0] == 401
        assert http.call("GET", "/metrics")[0] == 401
        assert http.call("GET", "/v1/pods", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert http.get("/healthz")[0] == 200  # probes stay open
        http.token = "s3cret"
        assert http.post("/v1/score", {"token_ids": [1]})[0] == 200
        assert http.get("/v1/pods")[0] == 200
    finally:
        svc.close()
        pub.shutdown(timeout=0.5)


def test_readiness_flips_when_the_late_join_replay_is_done(tmp_path) -> None:
    # the pod's publisher is not up yet: its late-join replay cannot be answered, so not ready
    cfg = from_dict({"router": {"model": MODEL}, "api": {"port": 0},
                     "subscriber": {"replay_timeout": 60.0},
                     "pods": [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub",
                               "replay_endpoint": f"ipc://{tmp_path}/a.replay"}]}).validate()
    svc = InProcessService(cfg)
    pub = None
    try:
        http = svc.http
        status, body = http.get("/readyz")
        assert status == 503 and body == {"ready": False, "waiting_for": ["a"]}
        assert http.get("/v1/pods")[1]["pods"][0]["state"] == "RECOVERING"
        pub = ZmqEventPublisher(f"ipc://{tmp_path}/a.pub", f"ipc://{tmp_path}/a.replay", topic="")
        wait_for(lambda: http.get("/readyz")[0] == 200, what="ready after the replay answered")
        assert http.get("/v1/pods")[1]["pods"][0]["state"] == "SYNCED"
    finally:
        svc.close()
        if pub is not None:
            pub.shutdown(timeout=0.5)


def test_a_never_heard_publisher_is_connecting_in_pods_and_not_ready(tmp_path) -> None:
    # no replay endpoint and nothing published yet: the subscriber says CONNECTING, and so must
    # /v1/pods (it used to roll CONNECTING up as SYNCED, and /readyz said ready)
    ep = f"ipc://{tmp_path}/a.pub"
    cfg = from_dict({"router": {"model": MODEL}, "api": {"port": 0},
                     "pods": [{"name": "a", "endpoint": ep}]}).validate()
    svc = InProcessService(cfg)
    pub = None
    try:
        http = svc.http
        def pod():
            p = http.get("/v1/pods")[1]["pods"][0]
            return p if p["state"] != "RECOVERING" else None  # RECOVERING: before the first refresh

        first = wait_for(pod, what="the pod's state from the subscriber's health")
        assert first["state"] == "CONNECTING" and not first["synced_once"]
        assert http.get("/readyz") == (503, {"ready": False, "waiting_for": ["a"]})
        pub = ZmqEventPublisher(ep, None, topic="")

        def heard():
            pub.publish(stored(TOKS, [1, 2, 3, 4]))
            return http.get("/v1/pods")[1]["pods"][0]["state"] == "SYNCED"

        wait_for(heard, what="SYNCED once a batch arrived")
        assert http.get("/readyz")[0] == 200
    finally:
        svc.close()
        if pub is not None:
            pub.shutdown(timeout=0.5)


def test_config_without_a_model_is_refused_at_start_naming_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"pods\[0\]\.model: .*topic \"\" does not carry one"):
        from_dict({"pods": [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub"}]}).validate()
    # a per-pod model is enough, and two models need no router.model
    cfg = from_dict({"pods": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557", "model": "x"},
                              {"name": "b", "endpoint": "tcp://127.0.0.1:5567", "model": "y"}]}).validate()
    assert cfg.models() == {"x", "y"}


def test_bind_mode_counts_and_logs_batches_it_cannot_attribute(tmp_path, caplog) -> None:
    """vLLM publishers connecting to a bind-mode service on the default topic "" that no pod
    claims: counted per publisher with the reason, logged once, shown in /v1/pods and metrics."""
    bind = f"ipc://{tmp_path}/in.sock"
    cfg = from_dict({"api": {"port": 0}, "subscriber": {"bind": bind, "late_join": False},
                     "pods": [{"name": "named", "topic": "kv-named", "model": MODEL}]}).validate()
    caplog.set_level(logging.WARNING, logger="kvservice")
    svc = InProcessService(cfg)
    anon = ZmqEventPublisher(bind, None, topic="", mode="connect")
    named = ZmqEventPublisher(bind, None, topic="kv-named", mode="connect")
    try:
        http = svc.http

        def both_arrived():
            named.publish(stored(TOKS, [1, 2, 3, 4]))
            anon.publish(stored(TOKS, [5, 6, 7, 8]))
            pods = http.get("/v1/pods")[1]
            return pods if pods["unattributed"] and pods["router"]["entries"] else None

        pods = wait_for(both_arrived, what="both publishers heard")
        u = pods["unattributed"][0]
        assert u["publisher"] == "" and u["batches"] >= 1 and "names no pod" in u["reason"]
        assert http.post("/v1/pick", {"token_ids": TOKS})[1]["pick"] == "named"
        text = http.call("GET", "/metrics")[2].decode()
        assert 'kvservice_unattributed_batches_total{publisher=""}' in text
        warnings = [r for r in caplog.records if "not indexed" in r.getMessage()]
        assert len(warnings) == 1, "logged once, however many batches"
    finally:
        anon.shutdown(timeout=0.5)
        named.shutdown(timeout=0.5)
        svc.close()


def test_a_gap_shows_the_pod_unreliable_and_a_reset_clears_it(tmp_path) -> None:
    from kvevents import Delivery, DeliveryKind
    from kvservice.ingest import Fleet

    cfg = from_dict({"router": {"model": MODEL}, "subscriber": {"late_join": False},
                     "pods": [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub"}]}).validate()
    fleet = Fleet(cfg)
    pub = ZmqEventPublisher(f"ipc://{tmp_path}/a.pub", None, topic="")
    try:
        # the first batch through the real subscriber (so it has heard the publisher: a pod
        # whose publisher was never heard is CONNECTING, not SYNCED)
        def heard():
            pub.publish(stored(TOKS, [1, 2, 3, 4]))
            for d in fleet.sub.poll(20):
                fleet.take(d)
            return fleet.router.score(TOKS, model=MODEL)["a"].matched_tokens > 0

        wait_for(heard, what="the first batch indexed")
        fleet.take(Delivery(DeliveryKind.GAP, "a", "", 1, missed=3, reason="lost"))
        fleet._refresh(2.0)
        assert fleet.pods["a"].state == "UNRELIABLE"
        assert fleet.pods["a"].uncertainty == {"factor": 0.5, "batches_left": 512}
        s = fleet.router.score(TOKS, model=MODEL)["a"]  # routed, discounted until it re-learns
        assert s.state == "UNRELIABLE" and s.factor == 0.5
        fleet.take(Delivery(DeliveryKind.RESET, "a", "", 0))
        fleet._refresh(3.0)
        assert fleet.pods["a"].state == "SYNCED" and fleet.unattributed == {}
    finally:
        fleet.stop()
        pub.shutdown(timeout=0.5)
