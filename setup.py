"""Build hook for the optional C extensions (metadata lives in pyproject.toml).

``consumers._fastpath`` speeds up the router's ingest and key hashing. It is optional: where
no C compiler is available the build skips it and the router runs in pure Python
(``consumers.fastpath_status()`` says which). ``manager.tiering._fsio`` is the fs tier's load
path and its one CRC32C routine (needs zlib.h); without it the tier reads in Python
(``stats()["native_io"]``) and writes zlib's CRC32.
"""

from pathlib import Path

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "consumers._fastpath",
            sources=["consumers/_fastpath.c"],
            depends=sorted(str(p) for p in Path("consumers").glob("*.h")),
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
