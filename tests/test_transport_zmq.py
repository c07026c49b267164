"""The ZeroMQ transport's one home: frame shapes, the topic format, and the old import paths."""

from __future__ import annotations

import pytest

import kvevents
from kvevents import topic
from kvevents.transport import zmq as tz
from kvevents.transport.zmq import frames


def test_old_module_paths_are_the_transport_objects():
    import kvevents.endpoints
    import kvevents.publisher
    import kvevents.subscriber

    assert kvevents.publisher.ZmqEventPublisher is tz.ZmqEventPublisher is kvevents.ZmqEventPublisher
    assert kvevents.subscriber.Subscriber is tz.Subscriber is kvevents.Subscriber
    assert kvevents.subscriber.PublisherSpec is tz.PublisherSpec
    assert kvevents.endpoints.validate_endpoint is tz.validate_endpoint
    assert kvevents.publisher.END_SEQ == kvevents.subscriber.END_SEQ == frames.END_SEQ == b"\xff" * 8
    from kvevents.recording import END_SEQ as rec_end
    assert rec_end is frames.END_SEQ


def test_frames_round_trip_and_reject_bad_shapes():
    assert frames.replay_request(6) == (b"", (6).to_bytes(8, "big"))
    assert frames.parse_replay_request([b"id", *frames.replay_request(6)]) == (b"id", 6)
    for bad in ([b"id", b"", b"\x01\x02"], [b"id", b"x", bytes(8)], [b"id", b""], [b"id", b"", bytes(8), b""]):
        assert frames.parse_replay_request(bad) is None
    ans = list(frames.replay_answer(b"id", b"t", 7, b"p"))
    assert ans == [b"id", b"", b"t", (7).to_bytes(8, "big"), b"p"]
    assert frames.is_replay_answer(ans[1:]) and not frames.is_end_marker(ans[1:])
    end = list(frames.end_marker(b"id"))[1:]
    assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert frames.is_end_marker(end) and frames.is_replay_answer(end)
    assert not frames.is_replay_answer([b"x", b"t", bytes(8), b"p"]) and not frames.is_replay_answer(ans[1:4])
    assert frames.is_live([b"t", frames.pack_seq(3), b"p"]) and frames.unpack_seq(frames.pack_seq(3)) == 3
    assert not frames.is_live([b"t", b"\x03", b"p"]) and not frames.is_live([b"t", bytes(8)])


@pytest.mark.parametrize("text, want", [
    ("kv@pod-a@m", ("pod-a", "m")),
    ("kv@pod-a@org/model@rev", ("pod-a", "org/model@rev")),
    ("kv@pod-a@", ("pod-a", None)),
    ("kv@pod-a", (None, None)),
    ("kv@@m", (None, None)),
    ("", (None, None)),
    ("other@pod@m", (None, None)),
])
def test_topic_format_is_parsed_in_one_place(text, want):
    from consumers.recordtools import topic_pod
    from consumers.router import pod_from_topic

    assert topic.parse_topic(text) == want == pod_from_topic(text)
    assert topic.topic_pod(text) == want[0] == topic_pod(text)


def test_make_topic_round_trips_and_refuses_pods_it_could_not_parse_back():
    assert kvevents.make_topic("pod-a", "org/m@1") == "kv@pod-a@org/m@1"
    assert kvevents.parse_topic(kvevents.make_topic("pod-a", "m")) == ("pod-a", "m")
    for pod in ("", "a@b"):
        with pytest.raises(ValueError, match="pod name"):
            kvevents.make_topic(pod, "m")
