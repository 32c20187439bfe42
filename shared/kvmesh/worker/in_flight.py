"""Requests a worker holds before its engine does, and which of them were cancelled.

A cancel is an engine abort, but a request waiting for room, pulling its KV or borrowing a
peer's prefix is not in the engine yet: the abort finds nothing, and the request would be
served for nobody (its blocks pinned until a TTL). The worker marks it here and looks
before each step that would hand it on. A cancel can also overtake its own work message
(they travel on different subjects), so the last ``remember`` cancelled ids are kept and a
request arriving after its cancel starts cancelled.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

REMEMBERED_CANCELS = 4096


@dataclass(slots=True)
class InFlight:
    remember: int = REMEMBERED_CANCELS
    active: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)
    _recent: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def start(self, request_id: str) -> None:
        self.active.add(request_id)
        if self._recent.pop(request_id, False) is None:  # its cancel came first
            self.cancelled.add(request_id)

    def cancel(self, request_id: str) -> None:
        if request_id in self.active:
            self.cancelled.add(request_id)
            return
        self._recent[request_id] = None
        self._recent.move_to_end(request_id)
        while len(self._recent) > self.remember:
            self._recent.popitem(last=False)

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self.cancelled

    def done(self, request_id: str) -> None:
        self.active.discard(request_id)
        self.cancelled.discard(request_id)
