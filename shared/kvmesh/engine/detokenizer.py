"""Incremental text of a request's output, with stop strings.

Text that could still turn out to be the start of a stop string is held back until it
cannot, so a client never receives part of a stop string.
"""

from __future__ import annotations

from kvmesh.engine.tokenizer import Tokenizer


class OutputText:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        """``min_tokens``: stop strings count only from the token after that many (vLLM's rule,
        as EOS is held back until then)."""
        self._stream = tokenizer.new_decode_stream(skip_special_tokens=True)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._min_tokens = min_tokens
        self._tokens = 0
        self.text = ""
        self._sent = 0

    def add_token(self, token_id: int) -> bool:
        """Append one token's text; True when a stop string appeared (the text is cut
        before it)."""
        self._tokens += 1
        piece = self._stream.step(token_id)
        if not piece:
            return False
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        if not self._stop or self._tokens <= self._min_tokens:
            return False
        found = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if not found:
            return False
        self.text = self.text[: min(found)]
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out, less what a stop string could still claim."""
        limit = len(self.text) if finished else max(self._sent, len(self.text) - self._hold)
        delta = self.text[self._sent : limit]
        self._sent = limit
        return delta
