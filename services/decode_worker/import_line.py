"""The order in which a decode worker's pulls take KV blocks while its pool is full: first
come, first served, retried requests (the router's second attempt: their client already
has tokens) ahead of new ones. Only the first in line tries for blocks, so a pull that came
later never takes the room an earlier one waits for, and no pull waits past its time while
later ones go ahead of it (each polling on its own, whichever polled first after a request
ended won: pulls timed out as overloaded, and the router prefilled them again)."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

Ticket = tuple[int, int]  # (0 for a retried request, 1 for a new one; arrival)


@dataclass(slots=True)
class ImportLine:
    """Pulls waiting for blocks, in the order they take them."""

    _line: list[Ticket] = field(default_factory=list)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    def join(self, *, retried: bool) -> Ticket:
        ticket = (0 if retried else 1, next(self._arrivals))
        bisect.insort(self._line, ticket)
        return ticket

    def is_first(self, ticket: Ticket) -> bool:
        return self._line[0] == ticket

    def leave(self, ticket: Ticket) -> None:
        self._line.remove(ticket)

    def __len__(self) -> int:
        return len(self._line)
