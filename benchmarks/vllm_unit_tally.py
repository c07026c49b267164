"""vLLM 0.33's own kv_offload unit tests, run against our plugin: a measure of how vLLM-shaped it is.

The test bodies are vLLM's, unchanged; only the module names they import are redirected: before
the tests are collected, ``vllm.v1.kv_offload.cpu.manager``, ``...tiering.manager`` and
``...tiering.factory`` are replaced by copies whose manager classes (and tier factory) are ours
(:mod:`kvevents_vllm.vllm_api`, :class:`manager.tiering.SecondaryTierFactory`). Everything else
(types, vLLM-written test tiers, vLLM's connector) stays vLLM's.

The tests come from vLLM's source distribution: give its unpacked root (or the ``.tar.gz``)
with ``--tests``, else the script fetches ``vllm-<version>.tar.gz`` from PyPI's simple index
into ``--cache`` (``pip download --no-binary`` cannot: it builds the package's metadata, which
needs vLLM's build toolchain). It says so and exits 2 when it cannot get them.

Each failure is put in one class, from its error:

- ``behaviour``: an assertion failed (our manager answered differently);
- ``missing``: a name or signature vLLM's tests use is absent (AttributeError on a public name,
  TypeError from a call, ImportError, or our one-line refusal of an unsupported option);
- ``internals``: the test reaches into vLLM internals (a private attribute, a vLLM-only helper,
  a mocked shared region).

Run with the 0.33 peer environment: ``/work/peer-vllm/bin/python benchmarks/vllm_unit_tally.py``;
``--baseline`` runs the same tests against vLLM's own classes (they should pass).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

FILES = ("cpu/test_manager.py", "tiering/test_tiering_offloading.py", "tiering/test_factory.py")
SUPPORT = ("conftest.py", "__init__.py", "cpu/__init__.py", "tiering/__init__.py")

REDIRECT = '''
"""pytest plugin: vLLM's kv_offload manager modules, with our classes under vLLM's names."""
import importlib, sys, types

def _redirect(name, **ours):
    original = importlib.import_module(name)
    copy = types.ModuleType(name)
    copy.__dict__.update({k: v for k, v in vars(original).items() if k not in ("__name__", "__spec__")})
    copy.__dict__.update(ours)
    copy.__kvevents_redirected__ = sorted(ours)
    sys.modules[name] = copy
    parent, _, leaf = name.rpartition(".")
    setattr(sys.modules[parent], leaf, copy)

from kvevents_vllm import vllm_api
from kvevents_vllm.vllm_tiers import register_vllm_tiers
from manager.tiering import SecondaryTierFactory

register_vllm_tiers()
_redirect("vllm.v1.kv_offload.cpu.manager", CPUOffloadingManager=vllm_api.CPUOffloadingManager)
_redirect("vllm.v1.kv_offload.tiering.manager", CPUOffloadingManager=vllm_api.CPUOffloadingManager,
          CPUPrimaryTierOffloadingManager=vllm_api.CPUPrimaryTierOffloadingManager,
          TieringOffloadingManager=vllm_api.TieringOffloadingManager)
_redirect("vllm.v1.kv_offload.tiering.factory", SecondaryTierFactory=SecondaryTierFactory)
'''


def fetch_sdist(version: str, cache: Path) -> Path | None:
    """``vllm-<version>.tar.gz`` from PyPI's simple index (checked against its sha256)."""
    import hashlib

    target = cache / f"vllm-{version}.tar.gz"
    if target.exists():
        return target
    try:
        page = urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=60).read().decode()
        m = re.search(rf'href="([^"]*/vllm-{re.escape(version)}\.tar\.gz)#sha256=([0-9a-f]+)"', page)
        if m is None:
            return None
        cache.mkdir(parents=True, exist_ok=True)
        data = urllib.request.urlopen(m.group(1), timeout=600).read()
    except OSError as exc:
        print(f"could not fetch vllm-{version}.tar.gz: {exc}", file=sys.stderr)
        return None
    if hashlib.sha256(data).hexdigest() != m.group(2):
        print("the downloaded sdist does not match PyPI's sha256", file=sys.stderr)
        return None
    target.write_bytes(data)
    return target


def tests_root(source: Path) -> Path | None:
    """The ``tests/v1/kv_offload`` directory of an unpacked sdist, or of a ``.tar.gz`` (unpacked)."""
    if source.is_file():
        out = Path(tempfile.mkdtemp(prefix="vllm-sdist-"))
        with tarfile.open(source) as tar:
            members = [m for m in tar.getmembers() if "/tests/v1/kv_offload/" in m.name + "/"]
            tar.extractall(out, members=members, filter="data")
        found = list(out.glob("*/tests/v1/kv_offload"))
        return found[0] if found else None
    for cand in (source / "tests/v1/kv_offload", source):
        if (cand / "cpu/test_manager.py").exists():
            return cand
    return None


def stage(kv_offload: Path, work: Path, baseline: bool) -> Path:
    """A rootdir holding ``tests/v1/kv_offload/...`` (vLLM's files, unchanged) and the plugin."""
    dst = work / "tests/v1/kv_offload"
    for rel in SUPPORT + FILES:
        src = kv_offload / rel
        if src.exists():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst / rel)
    for pkg in (work / "tests", work / "tests/v1"):
        (pkg / "__init__.py").touch()
    (work / "kvevents_redirect.py").write_text("" if baseline else REDIRECT)
    return dst


def classify(message: str, text: str) -> str:
    blob = f"{message}\n{text}"
    if re.search(r"has no attribute '_|MagicMock|mmap_region|_make_manager|\._policy|_num_evictable|\._registry|\._req_state", blob):
        return "internals"
    if re.search(r"^E\s+(AssertionError|assert )", text, re.M) and not re.search(r"^E\s+(TypeError|AttributeError)", text, re.M):
        return "behaviour"
    if re.search(r"AttributeError|TypeError|ImportError|ModuleNotFoundError|NotImplementedError|ConfigError|"
                 r"not supported", blob):
        return "missing"
    return "behaviour"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", type=Path, help="vLLM's unpacked sdist (or its .tar.gz)")
    ap.add_argument("--version", default="0.33.0")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "kvevents-vllm-sdist")
    ap.add_argument("--baseline", action="store_true", help="vLLM's own classes (no redirect)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each failure's first error line")
    args = ap.parse_args()

    import vllm

    source = args.tests or fetch_sdist(args.version, args.cache)
    root = tests_root(source) if source is not None else None
    if root is None:
        where = f"{args.tests} holds no tests/v1/kv_offload" if args.tests else "the sdist could not be fetched"
        print(f"vLLM {args.version}'s kv_offload unit tests are ABSENT ({where}); nothing was run", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="vllm-tally-"))
    try:
        dst = stage(root, work, args.baseline)
        junit = work / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "kvevents_redirect", "-p", "no:cacheprovider",
               "-o", "addopts=", "--rootdir", str(work), f"--junitxml={junit}",
               *[str(dst / f) for f in FILES if (dst / f).exists()]]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        if not junit.exists():
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        per_file: dict[str, Counter] = {}
        failures = []
        for case in ET.parse(junit).iter("testcase"):
            f = (case.get("classname") or "").replace("tests.v1.kv_offload.", "").split(".")[:2]
            name = "/".join(f[:2]) if f and f[0] in ("cpu", "tiering") else ".".join(f)
            counter = per_file.setdefault(name, Counter())
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if case.find("skipped") is not None:
                counter["skipped"] += 1
            elif bad is None:
                counter["passed"] += 1
            else:
                counter["failed"] += 1
                kind = classify(bad.get("message") or "", bad.text or "")
                counter[kind] += 1
                failures.append((name, case.get("name"), kind, (bad.get("message") or "").splitlines()[0][:150]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    what = "vLLM's own classes (baseline)" if args.baseline else "our plugin (kvevents_vllm.vllm_api)"
    print(f"vLLM {vllm.__version__} kv_offload unit tests (sdist {args.version}) against {what}")
    print(f"{'file':<34}{'passed':>8}{'failed':>8}{'skipped':>8}{'behaviour':>11}{'missing':>9}{'internals':>11}")
    total = Counter()
    for name, c in sorted(per_file.items()):
        total.update(c)
        print(f"{name:<34}{c['passed']:>8}{c['failed']:>8}{c['skipped']:>8}{c['behaviour']:>11}{c['missing']:>9}"
              f"{c['internals']:>11}")
    print(f"{'total':<34}{total['passed']:>8}{total['failed']:>8}{total['skipped']:>8}{total['behaviour']:>11}"
          f"{total['missing']:>9}{total['internals']:>11}")
    if args.verbose:
        for name, test, kind, msg in failures:
            print(f"  [{kind}] {name}::{test}: {msg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
