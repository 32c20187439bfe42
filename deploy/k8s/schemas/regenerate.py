"""Regenerate the vendored schemas of the Prometheus Operator's ServiceMonitor and
PrometheusRule (monitoring.coreos.com/v1) that tests/test_deploy.py validates kvmesh's
manifests against (kubernetes-validate knows no CRDs).

Source: the PyPI package ``cloudcoil-models-prometheus-operator`` (pinned below), whose
models are generated from the Prometheus Operator's CRDs (their ``openAPIV3Schema``) by
cloudcoil's codegen; this writes each model's JSON Schema (by the CRD's field names) and then
makes it say what a cluster does with a structural schema: every object that lists its
properties takes no other (an unknown field fails here where the API server would prune it
silently), optional fields are not nullable, and ``apiVersion``, ``kind``, ``metadata`` and
``spec`` are required. Maps (``labels``, ``annotations``, ...) keep their open values.

    .venv/bin/python deploy/k8s/schemas/regenerate.py

installs the pinned packages into a temporary folder (pip, no dependencies: pydantic,
httpx and PyYAML come from the running virtualenv) and rewrites the two files beside this
script. Bump ``MODELS`` to follow a newer operator and rerun; the test then says what of
kvmesh's manifests the new schema refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CLOUDCOIL = "cloudcoil==0.6.0"
MODELS = "cloudcoil-models-prometheus-operator==0.80.1.0"  # the operator's v0.80.1 CRDs
KINDS = ("ServiceMonitor", "PrometheusRule")
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def strict(node: Any) -> Any:
    """The schema with every object closed, nulls refused and pydantic's titles and
    defaults dropped (they validate nothing); a Go pattern's leading ``^(?i)`` is written
    ``(?i)^`` (the same match; Python takes flags only first)."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    options = node.get("anyOf")
    if isinstance(options, list) and {"type": "null"} in options:
        rest = [o for o in options if o != {"type": "null"}]
        merged = {k: v for k, v in node.items() if k != "anyOf"}
        merged.update(rest[0] if len(rest) == 1 else {"anyOf": rest})
        return strict(merged)
    out = {k: strict(v) for k, v in node.items() if k not in ("title", "default")}
    pattern = out.get("pattern")
    if isinstance(pattern, str) and pattern.startswith("^(?i)"):  # Go's flag after the anchor; Python's first
        out["pattern"] = "(?i)^" + pattern[len("^(?i)") :]
    if out.get("type") == "object" and "properties" in out:
        out["additionalProperties"] = False
    return out


def schema_of(kind: str) -> dict:
    from cloudcoil.models.prometheus_operator import v1  # type: ignore[import-not-found]

    schema = strict(getattr(v1, kind).model_json_schema(by_alias=True, mode="validation"))
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return {
        "$schema": DIALECT,
        "$comment": (
            f"The Prometheus Operator's {kind} CRD (monitoring.coreos.com/v1) as the PyPI package {MODELS} "
            f"(with {CLOUDCOIL}) generates it from the CRD's openAPIV3Schema, closed as a structural schema prunes: "
            "written by deploy/k8s/schemas/regenerate.py, do not edit"
        ),
        **schema,
    }


def write() -> None:
    for kind in KINDS:
        path = HERE / f"{kind.lower()}.monitoring.coreos.com-v1.json"
        path.write_text(json.dumps(schema_of(kind), indent=1, sort_keys=True) + "\n")
        print(f"wrote {path.relative_to(HERE.parents[2])}")


def main() -> None:
    if os.environ.get("KVMESH_SCHEMA_PACKAGES"):  # the second pass: the packages are on the path
        write()
        return
    with tempfile.TemporaryDirectory() as target:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target, CLOUDCOIL, MODELS],
            check=True,
            timeout=600,
        )
        env = {**os.environ, "KVMESH_SCHEMA_PACKAGES": target, "PYTHONPATH": target}
        subprocess.run([sys.executable, __file__], check=True, env=env, timeout=600)


if __name__ == "__main__":
    main()
