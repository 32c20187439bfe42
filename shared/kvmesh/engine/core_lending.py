"""Cores lent between engines that share a machine (``kvmesh up``'s default where its workers
split the cores; ``--lend-cores``).

Each engine has its share of the cores (``own`` threads: ``kvmesh up`` splits the cores
between its workers); while every other engine sharing the board is idle, it runs on all
the cores its process may use (``most``). On two cores a 1 + 1 mesh otherwise leaves a core
unused whenever one worker has nothing to do (a prefill worker while the decode worker
prefills a chat's next turn itself, a decode worker waiting for prefills). Giving each worker
all the cores instead does not do it: where both are busy, their OpenMP teams share cores
and every operator waits for a helper that is not running (measured: a quarter to a half
of the throughput, docs/benchmarks.md).

The board is a file of one byte per engine (``create``), mapped by every engine: its own
byte says whether it is idle, busy on its share, or busy on more (borrowing). Before each
step an engine marks itself busy and reads the others'; when it waits for work it marks
itself idle. An engine turning busy while another borrows its cores waits for the borrower
to give them back (at most ``HANDOVER`` seconds): kvmesh's engine reads the board between
the layers of its step (``give_back``) and keeps to its share from the next layer on, so the
wait is one layer's time, not a whole step's (a 1,024-token prefill chunk borrowing both
cores takes longer than ``HANDOVER``). A vLLM engine gives them back only at the end of its
step: its CPU attention fixes a step's thread count. Not waiting, the two would run on the same cores, where
the borrower's OpenMP team stalls on a helper that is not running and the newcomer runs at
half speed. An engine that dies busy leaves its byte set, so the others keep to their share
until it is back (it clears its byte when it starts), and one that dies borrowing costs each
other engine turning busy a ``HANDOVER`` wait until then.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CoreLending", "LendingCounts", "parse_lending"]

IDLE, OWN, BORROWING = 0, 1, 2  # an engine's byte on the board
HANDOVER = 0.25  # seconds an engine turning busy waits at most for a borrower to give its cores back


@dataclass(slots=True)
class LendingCounts:
    """What one engine's lending did since it started (its worker's ``kvmesh:core_lending``)."""

    borrowed: int = 0  # steps begun on more than its share: the other engines idle
    given_back: int = 0  # borrowed steps that gave the cores back between layers (another engine turned busy)
    wait_given_up: int = 0  # turning busy, waits for a borrower that ended after ``HANDOVER`` without it


class CoreLending:
    """One engine's view of the board: ``threads_for_step`` before a step, ``idle`` while
    it waits for work. Called on the engine thread only."""

    def __init__(self, path: Path, slot: int, own: int, most: int) -> None:
        with open(path, "r+b") as f:
            self._board = mmap.mmap(f.fileno(), 0)
        if not 0 <= slot < len(self._board):
            raise ValueError(f"core lending slot {slot} is not on the board {path} ({len(self._board)} slots)")
        self.slot = slot
        self.own = max(1, own)
        self.most = max(self.own, most)
        self.counts = LendingCounts()
        self._mark(IDLE)  # a restarted engine's byte may say its last run's state

    @staticmethod
    def create(path: Path, slots: int) -> None:
        """A board for ``slots`` engines, all idle."""
        path.write_bytes(bytes(slots))

    @staticmethod
    def mark_idle(path: Path, slot: int) -> None:
        """``slot``'s engine idle on the board at ``path``, from outside it: the engine is dead."""
        with open(path, "r+b") as board:
            board.seek(slot)
            board.write(bytes([IDLE]))

    def threads_for_step(self) -> int:
        """Mark this engine busy; the threads of its next step: ``most`` while every other
        engine is idle, else ``own`` (once a borrower's step in flight has ended)."""
        if self._board[self.slot] == IDLE:
            self._mark(OWN)
            give_up = time.monotonic() + HANDOVER
            while BORROWING in self._others():
                if time.monotonic() >= give_up:
                    self.counts.wait_given_up += 1
                    break
                time.sleep(0.0005)
        if any(self._others()) or self.most == self.own:
            self._mark(OWN)
            return self.own
        self._mark(BORROWING)
        self.counts.borrowed += 1
        return self.most

    def give_back(self) -> int | None:
        """Within a step (between its layers): ``own``, marked busy on its share, once another
        engine has turned busy while this one borrows (that one waits for it); else None."""
        if self._board[self.slot] != BORROWING or not any(self._others()):
            return None
        self._mark(OWN)
        self.counts.given_back += 1
        return self.own

    def idle(self) -> None:
        self._mark(IDLE)

    def _mark(self, state: int) -> None:
        if self._board[self.slot] != state:
            self._board[self.slot] = state

    def _others(self) -> bytes:
        board = self._board[:]
        return board[: self.slot] + board[self.slot + 1 :]

    def close(self) -> None:
        self.idle()
        self._board.close()


def parse_lending(spec: str, own: int | None) -> CoreLending:
    """``PATH:SLOT`` (``--lend-cores``) for an engine of ``own`` threads (None: all)."""
    path, _, slot = spec.rpartition(":")
    if not path or not slot.isdigit():
        raise ValueError(f"--lend-cores takes PATH:SLOT, not {spec!r}")
    most = len(os.sched_getaffinity(0))
    return CoreLending(Path(path), int(slot), own or most, most)
