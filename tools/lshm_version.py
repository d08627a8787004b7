#!/usr/bin/env python3
"""Print libshm's version, "major.minor.patch", as libshm/include/lshm.h states it (its
LSHM_VERSION_* macros: the one place the version is written; meson.build reads it here)."""

import pathlib
import re
import sys

HEADER = pathlib.Path(__file__).resolve().parent.parent / "libshm" / "include" / "lshm.h"


def version(header: pathlib.Path = HEADER) -> str:
    text = header.read_text()
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        found = re.search(rf"^#define LSHM_VERSION_{name} (\d+)$", text, re.MULTILINE)
        if found is None:
            sys.exit(f"{header}: no LSHM_VERSION_{name}")
        parts.append(found.group(1))
    return ".".join(parts)


if __name__ == "__main__":
    print(version())
