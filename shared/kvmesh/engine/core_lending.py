"""Cores lent between engines that share a machine (``kvmesh up --lend-cores``).

Each engine has its share of the cores (``own`` threads: ``kvmesh up`` splits the cores
between its workers); while every other engine sharing the board is idle, it runs on all
the cores its process may use (``most``). On two cores a 1 + 1 mesh otherwise leaves a core
unused whenever one worker has nothing to do (a prefill worker while the decode worker
prefills a chat's next turn itself, a decode worker waiting for prefills). Giving each worker
all the cores instead does not do it: where both are busy, their OpenMP teams share cores
and every operator waits for a helper that is not running (measured: a third of the
throughput, docs/benchmarks.md).

The board is a file of one byte per engine (``create``), mapped by every engine: its own
byte says whether it has work. Before each step an engine marks itself busy and reads the
others'; when it waits for work it marks itself idle. A step started on ``most`` threads
when another engine turns busy runs on beside it until it ends; the next one takes ``own``.
An engine that dies busy leaves its byte set, so the others keep to their share until it
is back (it clears its byte when it starts).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

__all__ = ["CoreLending", "parse_lending"]


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
        self._busy = True
        self.idle()

    @staticmethod
    def create(path: Path, slots: int) -> None:
        """A board for ``slots`` engines, all idle."""
        path.write_bytes(bytes(slots))

    def threads_for_step(self) -> int:
        """Mark this engine busy; the threads of its next step: ``most`` while every other
        engine is idle, else ``own``."""
        if not self._busy:
            self._board[self.slot] = 1
            self._busy = True
        board = self._board[:]
        others = board[: self.slot] + board[self.slot + 1 :]
        return self.own if any(others) else self.most

    def idle(self) -> None:
        if self._busy:
            self._board[self.slot] = 0
            self._busy = False

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
