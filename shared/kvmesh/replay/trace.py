"""Read and check a request trace in the Mooncake format.

One JSON object per line: ``{"timestamp": <ms since start>, "input_length": <tokens>,
"output_length": <tokens>, "hash_ids": [<int>, ...]}``. ``hash_ids`` are chained prefix-block
ids, one per ``block_size``-token block (the last block may be short), so
``len(hash_ids) == ceil(input_length / block_size)`` and two requests share a prefix of k
blocks exactly when their first k ids are equal. Blank lines are skipped.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import KvmeshError

logger = logging.getLogger(__name__)

MOONCAKE_BLOCK_SIZE = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(KvmeshError, ValueError):
    """The trace cannot be read or a line is malformed (the message names the line)."""


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request: ``index`` is its line's position among the requests (0-based),
    ``arrival`` is in seconds (the timestamp times the time scale)."""

    index: int
    arrival: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace(
    lines: Iterable[str],
    *,
    time_scale: float = 1.0,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    source: str = "trace",
) -> list[TraceRequest]:
    """Requests in arrival order (ties keep file order). ``time_scale`` multiplies the
    timestamps: 2.0 spreads arrivals twice as far apart, 0.5 packs them twice as close."""
    if not isinstance(time_scale, (int, float)) or not math.isfinite(time_scale) or time_scale <= 0:
        raise TraceError(f"time scale must be a positive number, got {time_scale!r}")
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        requests.append(_parse_line(line, number, len(requests), time_scale, block_size, source))
    if not requests:
        raise TraceError(f"{source}: no requests")
    requests.sort(key=lambda r: r.arrival)  # stable: equal timestamps keep file order
    return requests


def load_trace(path: str | Path, *, time_scale: float = 1.0, block_size: int = MOONCAKE_BLOCK_SIZE) -> list[TraceRequest]:
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as lines:
            requests = parse_trace(lines, time_scale=time_scale, block_size=block_size, source=str(path))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text: {exc.reason}") from None
    logger.info("read %d requests from %s", len(requests), path)
    return requests


def _parse_line(line: str, number: int, index: int, time_scale: float, block_size: int, source: str) -> TraceRequest:
    where = f"{source}, line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object with {', '.join(_FIELDS)}")
    missing = [f for f in _FIELDS if f not in record]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    timestamp = record["timestamp"]
    if not _is_number(timestamp) or timestamp < 0:
        raise TraceError(f"{where}: timestamp must be a number of milliseconds >= 0, got {timestamp!r}")
    input_length = record["input_length"]
    if not _is_int(input_length) or input_length < 1:
        raise TraceError(f"{where}: input_length must be a positive integer, got {input_length!r}")
    output_length = record["output_length"]
    if not _is_int(output_length) or output_length < 0:
        raise TraceError(f"{where}: output_length must be an integer >= 0, got {output_length!r}")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    expected = -(-input_length // block_size)
    if len(hash_ids) != expected:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; "
            f"{block_size}-token blocks need {expected}"
        )
    return TraceRequest(index, timestamp / 1000.0 * time_scale, input_length, output_length, tuple(hash_ids))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]
