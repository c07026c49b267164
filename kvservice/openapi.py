"""The OpenAPI 3 document of the API (served at ``/openapi.json``; the schema tests read it)."""

from __future__ import annotations

__all__ = ["openapi_document"]


def _error() -> dict:
    return {"description": "a JSON error naming the field",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _json(ref: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": ref}}}}


_SCORE_BODY = {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ScoreRequest"}}}}
_ERRORS = {"400": _error(), "401": _error(), "404": _error(), "413": _error(), "415": _error()}

SCHEMAS = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["type", "message", "status"],
        "properties": {"type": {"type": "string"}, "field": {"type": ["string", "null"]},
                       "message": {"type": "string"}, "status": {"type": "integer"}}}}},
    "ChatMessage": {"type": "object", "required": ["role"],
                    "properties": {"role": {"type": "string"}, "content": {"type": ["string", "null"]}}},
    "ScoreRequest": {
        "type": "object", "additionalProperties": False,
        "description": "exactly one of token_ids, prompt, messages (prompt/messages need a tokenizer)",
        "properties": {
            "model": {"type": "string", "description": "may be left out when the fleet serves one model"},
            "lora_name": {"type": ["string", "null"]},
            "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 4294967295},
                          "minItems": 1},
            "prompt": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}, "minItems": 1},
            "load": {"type": "object", "additionalProperties": {"type": "number"},
                     "description": "pod -> load (RouterConfig.load_weight applies)"}}},
    "PodScore": {"type": "object", "properties": {
        "pod": {"type": "string"}, "total": {"type": "number"}, "matched_tokens": {"type": "integer"},
        "tokens_by_tier": {"type": "object", "additionalProperties": {"type": "integer"}},
        "state": {"type": "string", "enum": ["CONNECTING", "SYNCED", "RECOVERING", "STALE", "UNRELIABLE"]},
        "rank": {"type": ["integer", "null"]}, "factor": {"type": "number"}, "load": {"type": "number"}}},
    "ScoreResponse": {"type": "object", "required": ["model", "prompt_tokens", "pick", "pods"], "properties": {
        "model": {"type": "string"}, "prompt_tokens": {"type": "integer"}, "pick": {"type": ["string", "null"]},
        "pods": {"type": "array", "items": {"$ref": "#/components/schemas/PodScore"}}}},
    "PickResponse": {"type": "object", "required": ["model", "pick"], "properties": {
        "model": {"type": "string"}, "pick": {"type": ["string", "null"]}, "prompt_tokens": {"type": "integer"}}},
    "ExplainResponse": {"type": "object", "required": ["model", "pods"], "properties": {
        "model": {"type": "string"}, "prompt_tokens": {"type": "integer"},
        "pods": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "object"}}}}},
    "PodStatus": {"type": "object", "properties": {
        "name": {"type": "string"}, "model": {"type": ["string", "null"]}, "configured": {"type": "boolean"},
        "state": {"type": "string", "enum": ["CONNECTING", "SYNCED", "RECOVERING", "STALE", "UNRELIABLE"]},
        "synced_once": {"type": "boolean"}, "last_seq": {"type": "integer"},
        "last_recv_age_s": {"type": ["number", "null"]}, "lag_s": {"type": ["number", "null"]},
        "batches": {"type": "integer"}, "gaps": {"type": "integer"}, "unrecoverable": {"type": "integer"},
        "resets": {"type": "integer"}, "malformed": {"type": "object"},
        "publishers": {"type": "array", "items": {"type": "string"}},
        "state_changes": {"type": "integer", "description": "transitions of state since it first synced"},
        "connected": {"type": ["boolean", "null"], "description": "its publishers' connections all up (null: not known)"},
        "disconnects": {"type": "integer", "description": "connections to its publishers lost"},
        "uncertainty": {"type": ["object", "null"], "description": "while UNRELIABLE: the score discount now "
                        "(factor) and the batches until it ends (batches_left; null: until a reset or clear)",
                        "properties": {"factor": {"type": "number"}, "batches_left": {"type": ["integer", "null"]}}},
        "entries_by_tier": {"type": "object", "additionalProperties": {"type": "integer"},
                            "description": "this pod's indexed (block, rank) entries per tier (ranks summed); "
                                           "recomputed at most once a second while the index changes"},
        "proxy_down": {"type": "boolean", "description": "proxy mode: the pod's circuit breaker is open (docs/proxy.md)"}}},
    "Pods": {"type": "object", "required": ["pods", "unattributed", "ready"], "properties": {
        "pods": {"type": "array", "items": {"$ref": "#/components/schemas/PodStatus"}},
        "unattributed": {"type": "array", "items": {"type": "object", "properties": {
            "publisher": {"type": "string"}, "reason": {"type": "string"}, "batches": {"type": "integer"}}}},
        "ready": {"type": "boolean"}, "ingest_errors": {"type": "integer"}, "deliveries": {"type": "integer"},
        "router": {"type": "object"}}},
}


def openapi_document(proxy: bool = False) -> dict:
    post = lambda summary, ref: {"summary": summary, "requestBody": _SCORE_BODY,  # noqa: E731
                                 "responses": {"200": _json(ref, "the answer"), **_ERRORS}}
    paths = {
        "/v1/score": {"post": post("every pod's matched tokens by tier, weighted total, state, and the pick",
                                   "#/components/schemas/ScoreResponse")},
        "/v1/pick": {"post": post("the pod with the highest score", "#/components/schemas/PickResponse")},
        "/v1/explain": {"post": post("per pod and rank: what matched, tier by tier, and why the match ended",
                                     "#/components/schemas/ExplainResponse")},
        "/v1/pods": {"get": {"summary": "per pod: state, last seq, lag, counters; unattributed publishers",
                             "responses": {"200": _json("#/components/schemas/Pods", "the fleet"), "401": _error()}}},
        "/healthz": {"get": {"summary": "the process is alive", "security": [],
                             "responses": {"200": {"description": "alive"}}}},
        "/readyz": {"get": {"summary": "every configured pod synced once (late-join replay done)", "security": [],
                            "responses": {"200": {"description": "ready"}, "503": {"description": "not yet"}}}},
        "/metrics": {"get": {"summary": "Prometheus text exposition",
                             "responses": {"200": {"description": "metrics", "content": {"text/plain": {}}},
                                           "401": _error()}}},
        "/openapi.json": {"get": {"summary": "this document", "responses": {"200": {"description": "OpenAPI 3"}}}},
    }
    if proxy:
        for path in ("/v1/completions", "/v1/chat/completions"):
            paths[path] = {"post": {
                "summary": "OpenAI-compatible: forwarded unchanged to the pod where it costs least (KV score and "
                           "live load); the answer carries x-kvevents-pod, x-kvevents-matched-tokens and "
                           "x-kvevents-attempts",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
                "responses": {"200": {"description": "the pod's answer (JSON, or text/event-stream when stream)"},
                              "429": _error(), "502": _error(), "503": _error(), "504": _error(), **_ERRORS}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvevents router", "version": "1",
                 "description": "KV-cache-aware scoring over a fleet's KV events, and an OpenAI-compatible proxy"},
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
    }
