"""Build hook for the one optional C extension (metadata lives in pyproject.toml).

``consumers._fastpath`` speeds up the router's ingest and key hashing. It is optional: where
no C compiler is available the build skips it and the router runs in pure Python
(``consumers.fastpath_status()`` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "consumers._fastpath",
            sources=["consumers/_fastpath.c"],
            depends=[f"consumers/{h}" for h in ("_fp_hash.h", "_fp_parse.h", "_fp_apply.h", "_fp_score.h", "_fp_score_pods.h", "_masktable.h", "_masktable_map.h",
                                                 "_masktable_ops.h", "_learned.h", "_learned_py.h")],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wno-unused-variable"],
        )
    ]
)
