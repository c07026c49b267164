"""The router without its C extension: where no compiler built it (or KVEVENTS_PURE_PYTHON=1),
everything runs in pure Python with the same answers. Runs the router's own tests that way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_router_tests_pass_in_pure_python():
    env = dict(os.environ, KVEVENTS_PURE_PYTHON="1", CI=os.environ.get("CI", "1"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_router.py",
           "tests/test_router_props.py", "tests/test_router_fastpath.py", "tests/test_contract.py",
           "tests/test_index_contract.py", "tests/test_router_snapshot.py", "tests/test_router_pods.py"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
    assert "C fast path not in use: disabled by KVEVENTS_PURE_PYTHON" in out.stdout  # the C-only tests skipped
