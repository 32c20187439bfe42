"""Which of kvmesh's worker dependencies a vLLM virtualenv lacks (`make vllm`).

`python -m kvmesh.worker.vllm_deps constraints.txt NAME...` prints `NAME==VERSION` (the
version pinned in the constraints file) for each NAME not installed, one a line, so that
the packages vLLM already brings keep vLLM's versions. Standard library only.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path


def pins(constraints: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[_norm(name)] = version.strip()
    return out


def missing(names: list[str], constraints: Path) -> list[str]:
    pinned = pins(constraints)
    wanted: list[str] = []
    for name in names:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = pinned.get(_norm(name))
            wanted.append(f"{name}=={version}" if version else name)
    return wanted


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        sys.stderr.write("usage: python -m kvmesh.worker.vllm_deps CONSTRAINTS NAME...\n")
        return 2
    for spec in missing(argv[1:], Path(argv[0])):
        sys.stdout.write(spec + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
