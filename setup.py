"""Build of the C core (cxlkv._core._native); metadata lives in pyproject.toml.

CXLKV_SANITIZE=1 builds the extension with AddressSanitizer and
UndefinedBehaviorSanitizer (see README, "Sanitizer build").
"""
import os

from setuptools import Extension, setup

cflags = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration",
          "-Wno-missing-field-initializers", "-fno-strict-aliasing"]
ldflags = []
if os.environ.get("CXLKV_SANITIZE") == "1":
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
           "-fno-omit-frame-pointer", "-g", "-O1"]
    cflags += san
    ldflags += ["-fsanitize=address,undefined"]

setup(
    ext_modules=[
        Extension(
            "cxlkv._core._native",
            sources=["cxlkv/_core/src/module.c", "cxlkv/_core/src/mapping.c",
                     "cxlkv/_core/src/lock.c", "cxlkv/_core/src/layout.c",
                     "cxlkv/_core/src/args.c", "cxlkv/_core/src/crashpoint.c",
                     "cxlkv/_core/src/cpu.c", "cxlkv/_core/src/alloc.c",
                     "cxlkv/_core/src/nc.c", "cxlkv/_core/src/kv.c", "cxlkv/_core/src/lru.c",
                     "cxlkv/_core/src/journal.c", "cxlkv/_core/src/lockmgr.c",
                     "cxlkv/_core/src/slabs.c", "cxlkv/_core/src/hostlock.c",
                     "cxlkv/_core/src/poolwait.c", "cxlkv/_core/src/gather.c",
                     "cxlkv/_core/src/spill.c", "cxlkv/_core/src/spill_pool.c",
                     "cxlkv/_core/src/spill_xxh3_avx2.c",
                     "cxlkv/_core/src/spill_xxh3_avx512.c"],
            libraries=["xxhash", "pthread"],
            depends=["cxlkv/_core/src/cpu.h", "cxlkv/_core/src/core.h", "cxlkv/_core/src/nc.h",
                     "cxlkv/_core/src/cxlkv_format.h", "cxlkv/_core/src/spill_format.h",
                     "cxlkv/_core/src/spill_copysum.h"],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
        )
    ]
)
