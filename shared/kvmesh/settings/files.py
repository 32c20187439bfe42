"""The text of a file a setting names (API keys, rate limits, a routing config, a CA)."""

from __future__ import annotations

import errno
from pathlib import Path


def settings_text(path: str | Path) -> str:
    """The file's text as UTF-8. ``OSError`` says why it cannot be read, with ``strerror``
    saying it in words: a file that is not UTF-8 text (a binary, a key store) included."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise OSError(errno.EILSEQ, f"not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})", str(path)) from None
