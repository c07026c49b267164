"""Schema-driven tests: request bodies generated from the service's own OpenAPI document (valid
ones, and ones with a field of the wrong type), sent over real HTTP; never a 5xx, every 4xx a
JSON error, every 200 shaped as the document says."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents import ZmqEventPublisher
from kvservice.config import from_dict
from kvservice.openapi import openapi_document

from .service_helpers import MODEL, InProcessService, stored, wait_for

DOC = openapi_document(proxy=False)
SCHEMAS = DOC["components"]["schemas"]

_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                    max_leaves=6)


def strategy(schema: dict) -> st.SearchStrategy:
    """Instances of a (small) JSON schema."""
    if "$ref" in schema:
        return strategy(SCHEMAS[schema["$ref"].rsplit("/", 1)[1]])
    t = schema.get("type")
    if isinstance(t, list):
        return st.one_of([strategy({**schema, "type": x}) for x in t])
    if t == "null":
        return st.none()
    if t == "string":
        return st.sampled_from([MODEL, "other"]) if schema is SCHEMAS["ScoreRequest"]["properties"]["model"] else \
            st.text(min_size=schema.get("minLength", 0), max_size=20)
    if t == "integer":
        return st.integers(schema.get("minimum", -(2**40)), schema.get("maximum", 2**40))
    if t == "number":
        return st.floats(-1e6, 1e6, allow_nan=False)
    if t == "boolean":
        return st.booleans()
    if t == "array":
        return st.lists(strategy(schema["items"]), min_size=schema.get("minItems", 0), max_size=40)
    if t == "object":
        props = schema.get("properties", {})
        if not props:
            return st.dictionaries(st.text(min_size=1, max_size=6), strategy(schema.get("additionalProperties") or
                                                                              {"type": "number"}), max_size=3)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: strategy(v) for k, v in props.items() if k in required},
                                     optional={k: strategy(v) for k, v in props.items() if k not in required})
    return _ANY


def valid(instance: object, schema: dict) -> bool:
    """A small validator for the response schemas (types, required, items, $ref)."""
    if "$ref" in schema:
        return valid(instance, SCHEMAS[schema["$ref"].rsplit("/", 1)[1]])
    t = schema.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        pytypes = {"null": type(None), "string": str, "integer": int, "number": (int, float), "boolean": bool,
                   "array": list, "object": dict}
        if not any(isinstance(instance, pytypes[x]) and not (x in ("integer", "number") and isinstance(instance, bool))
                   for x in types):
            return False
    if "enum" in schema and instance not in schema["enum"]:
        return False
    if isinstance(instance, dict):
        if any(k not in instance for k in schema.get("required", ())):
            return False
        for k, sub in schema.get("properties", {}).items():
            if k in instance and not valid(instance[k], sub):
                return False
    if isinstance(instance, list) and "items" in schema:
        return all(valid(x, schema["items"]) for x in instance)
    return True


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    d = tmp_path_factory.mktemp("schema")
    pub = ZmqEventPublisher(f"ipc://{d}/a.pub", None, topic="")
    cfg = from_dict({"router": {"model": MODEL}, "api": {"port": 0, "max_body_bytes": 8192},
                     "pods": [{"name": "a", "endpoint": f"ipc://{d}/a.pub"}]}).validate()
    svc = InProcessService(cfg)
    http = svc.http

    def heard():
        pub.publish(stored(list(range(32)), [1, 2]))
        return http.get("/v1/pods")[1]["router"]["entries"] > 0

    wait_for(heard, what="pod heard")
    yield svc
    svc.close()
    pub.shutdown(timeout=0.5)


def _mutated(schema: dict) -> st.SearchStrategy:
    """A valid body with one property replaced by anything (often the wrong type)."""
    props = list(schema["properties"])
    return st.tuples(strategy(schema), st.sampled_from(props), _ANY).map(lambda t: {**t[0], t[1]: t[2]})


ROUTES = {"/v1/score": "ScoreResponse", "/v1/pick": "PickResponse", "/v1/explain": "ExplainResponse"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(route=st.sampled_from(sorted(ROUTES)),
       body=st.one_of(strategy(SCHEMAS["ScoreRequest"]), _mutated(SCHEMAS["ScoreRequest"]), _ANY))
def test_generated_bodies_never_5xx(service, route, body) -> None:
    status, headers, data = service.http.call("POST", route, body)
    assert status < 500, data
    answer = json.loads(data)
    if status == 200:
        assert valid(answer, SCHEMAS[ROUTES[route]]), answer
    else:
        assert 400 <= status < 500
        assert valid(answer, SCHEMAS["Error"]) and answer["error"]["status"] == status


def test_every_documented_get_route_answers_as_documented(service) -> None:
    for path, ops in DOC["paths"].items():
        if "get" not in ops:
            continue
        status, _h, data = service.http.call("GET", path)
        assert str(status) in ops["get"]["responses"], (path, status)
        if path == "/v1/pods":
            assert valid(json.loads(data), SCHEMAS["Pods"])
