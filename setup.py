"""Build hook for the optional C extensions (metadata lives in pyproject.toml).

``consumers._fastpath`` speeds up the router's ingest and key hashing. It is optional: where
no C compiler is available the build skips it and the router runs in pure Python
(``consumers.fastpath_status()`` says which). ``manager.tiering._fsio`` is the fs tier's load
path and its one CRC32C routine (needs zlib.h); without it the tier reads in Python
(``stats()["native_io"]``) and writes zlib's CRC32.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "consumers._fastpath",
            sources=["consumers/_fastpath.c"],
            depends=[f"consumers/{h}" for h in ("_fp_hash.h", "_fp_parse.h", "_fp_apply.h", "_fp_score.h", "_fp_score_pods.h",
                                                 "_fp_score_json.h", "_fp_score_answer.h", "_masktable.h", "_masktable_map.h",
                                                 "_masktable_ops.h", "_masktable_core.h", "_masktable_grow.h", "_oa.h", "_learned.h",
                                                 "_learned_py.h")],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wno-unused-variable"],
        ),
        Extension(
            "manager.tiering._fsio",
            sources=["manager/tiering/_fsio.c"],
            depends=["manager/tiering/_fsio_block.h", "manager/tiering/_fsio_crc.h"],
            libraries=["z"],
            optional=True,
            extra_compile_args=["-O2", "-Wall"],
        ),
    ]
)
