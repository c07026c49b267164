from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# CI runs the property tests on a fixed seed, so a landing never depends on luck; locally they
# explore fresh examples each run (and hypothesis's database replays what failed before).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """``../shared`` beside the checkout (CI puts it there), or $KVEVENTS_SHARED."""
    env = os.environ.get("KVEVENTS_SHARED")
    return Path(env) if env else ROOT.parent / "shared"


@pytest.fixture(scope="session")
def conformance_dir() -> Path:
    d = shared_dir() / "conformance"
    if not d.is_dir():
        pytest.fail(f"conformance corpus not found at {d}: put shared/ beside the checkout or set KVEVENTS_SHARED")
    return d
