"""pytest plugin of the consumer contract kit (registered as a ``pytest11`` entry point).

Fixtures:

``kv_recording``
    A factory: ``kv_recording(path, publisher=None)`` loads a recording (``.kvrec``) or
    converts a conformance capture (``.jsonl``) into a :class:`consumers.recordtools.Recording`.
``kv_vllm_capture``
    vLLM 0.33's live PUB + replay capture as a Recording, found through the ``kv_capture`` ini
    option, ``$KVEVENTS_CAPTURE``, or ``$KVEVENTS_SHARED/conformance/`` (else ``../shared``
    beside the rootdir); the test is skipped when it cannot be found.
``kv_contract``
    A :class:`consumers.contract.ContractChecker`. Feed it (``feed``, ``feed_delivery``,
    ``feed_all``); when the test body ends, every violation is listed and fails the test
    (call ``kv_contract.assert_ok()`` yourself to check earlier). Options come from the marker
    ``@pytest.mark.kv_contract(allow_unknown_removals=True, ...)``.
``kv_feed``
    ``kv_feed(consumer, source, **options)``: :func:`consumers.contract.feed` with ``kv_contract`` as
    checker: drives ``consumer.apply/reset_pod`` and checks the stream at the same time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest

from .contract import ContractChecker, ContractError, FeedReport, feed
from .recordtools import Recording

CAPTURE_NAME = "vllm-0.33.0-live-pub-replay.jsonl"
_CHECKER_ATTR = "_kv_contract_checker"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("kv_capture", "path of vLLM's live PUB + replay capture (.jsonl) for the kv_vllm_capture fixture")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kv_contract(**options): options of the kv_contract fixture's ContractChecker "
                   "(allow_unknown_removals, allow_unjoined_offloads, allow_gaps, check_gpu_shape, ...)")


@pytest.fixture
def kv_recording() -> Callable[..., Recording]:
    def load(source: str | os.PathLike, *, publisher: str | None = None) -> Recording:
        return Recording.load(source, publisher=publisher)
    return load


def _capture_path(config: pytest.Config) -> Path | None:
    candidates = []
    ini = config.getini("kv_capture")
    if ini:
        candidates.append(Path(ini) if os.path.isabs(ini) else Path(config.rootpath) / ini)
    if os.environ.get("KVEVENTS_CAPTURE"):
        candidates.append(Path(os.environ["KVEVENTS_CAPTURE"]))
    shared = os.environ.get("KVEVENTS_SHARED")
    candidates.append((Path(shared) if shared else Path(config.rootpath).parent / "shared") / "conformance" / CAPTURE_NAME)
    return next((c for c in candidates if c.is_file()), None)


@pytest.fixture
def kv_vllm_capture(request: pytest.FixtureRequest) -> Recording:
    path = _capture_path(request.config)
    if path is None:
        pytest.skip(f"{CAPTURE_NAME} not found: set the kv_capture ini option, $KVEVENTS_CAPTURE or $KVEVENTS_SHARED")
    return Recording.load(path)


@pytest.fixture
def kv_contract(request: pytest.FixtureRequest) -> ContractChecker:
    options: dict[str, Any] = {}
    for mark in reversed(list(request.node.iter_markers("kv_contract"))):
        options.update(mark.kwargs)  # the closest marker wins
    try:
        checker = ContractChecker(**options)
    except TypeError as exc:
        raise TypeError(f"@pytest.mark.kv_contract: {exc}") from None
    setattr(request.node, _CHECKER_ATTR, checker)
    return checker


@pytest.fixture
def kv_feed(kv_contract: ContractChecker) -> Callable[..., FeedReport]:
    def run(consumer: Any, source: Any, **options: Any) -> FeedReport:
        return feed(consumer, source, checker=kv_contract, **options)
    return run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    outcome = yield
    checker = getattr(item, _CHECKER_ATTR, None)
    if checker is None or checker.asserted or outcome.excinfo is not None:
        return
    try:
        checker.assert_ok()
    except ContractError as exc:
        failure = pytest.fail.Exception(f"kv_contract: {exc}", pytrace=False)  # the violations, no traceback
        if hasattr(outcome, "force_exception"):
            outcome.force_exception(failure)
        else:  # pluggy < 1.1
            raise failure from None
