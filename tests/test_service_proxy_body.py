"""The proxy's one-pass read of a completion body (``kvservice.proxy._token_prompt``): the same
answer as decoding the whole body, for the common shape and every shape that could fool a search
for the ``"prompt"`` key."""

from __future__ import annotations

import json

import pytest

from kvservice import proxy as proxy_mod
from kvservice.schema import ApiError

pytest.importorskip("consumers._fastpath")

P = proxy_mod.Proxy.__new__(proxy_mod.Proxy)


def _answer(raw: bytes):
    try:
        body, what = P._parse(raw, chat=False)
    except ApiError as exc:
        return ("error", exc.status, str(exc))
    ids = what if isinstance(what, str) else list(what)
    return (body.model, body.lora_name, ids)


def _whole(raw: bytes, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(proxy_mod, "_token_prompt", lambda raw: None)
        return _answer(raw)


BODIES = [
    b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}',
    b'{"prompt":[7,8],"model":"m","lora_name":"a"}',
    b'{"model": "m", "prompt" \n:\t [ 5 , 6 ] }',
    b'{"model": "m", "x": {"prompt": [1, 2]}, "prompt": [3, 4]}',  # a nested "prompt" first
    b'{"model": "m", "x": {"prompt": [1, 2]}, "prompt": "text"}',
    b'{"model": "m", "say \\"prompt": [1, 2], "prompt": [9]}',  # the key inside another key
    b'{"model": "m", "note": "\\"prompt\\": [1]", "prompt": [4]}',  # ... inside a string
    b'{"model": "m", "prompt": [1, 2], "prompt": [3]}',  # twice: whatever the decoder does
    b'{"model": "m", "prompt": [[1, 2], [3]]}',  # a batch
    b'{"model": "m", "prompt": [1, -2]}',
    b'{"model": "m", "prompt": [1, 2.5]}',
    b'{"model": "m", "prompt": [1, 4294967296]}',
    b'{"model": "m", "prompt": []}',
    b'{"model": "m", "prompt": [1, 2]',  # cut short
    b'{"model": "m", "prompt": [1, 2]} trailing',
    b'{"model": "m", "prompt": [1, 2], "x": [}',
    b'{"model": 5, "prompt": [1, 2]}',
    b'{"prompt": [1, 2]}',
    b'["prompt", [1, 2]]',
    b'{"model": "m", "prompt": [1, "]", 2]}',
    b'{"model": "m", "x": ["prompt": [1]], "prompt": [2]}',
]


@pytest.mark.parametrize("raw", BODIES)
def test_the_one_pass_read_answers_as_the_whole_decode(raw, monkeypatch) -> None:
    assert _answer(raw) == _whole(raw, monkeypatch)


def test_the_common_body_is_read_in_one_pass(monkeypatch) -> None:
    raw = json.dumps({"model": "m", "prompt": list(range(4000)), "max_tokens": 1}).encode()
    found = proxy_mod._token_prompt(raw)
    assert found is not None and found[0].model == "m" and list(found[1]) == list(range(4000))
    # a nested "prompt" is never taken for the top-level one
    assert proxy_mod._token_prompt(b'{"model": "m", "x": {"prompt": [1]}, "prompt": [2]}') is None


def test_a_client_cannot_forge_the_placeholder() -> None:
    # the placeholder is the process's secret: a body that sends its own guess at it is not fooled
    raw = b'{"model": "m", "x": {"prompt": [1, 2]}, "prompt": "kvevents-prompt-000000000000000000000000"}'
    assert proxy_mod._token_prompt(raw) is None
