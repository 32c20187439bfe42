"""``lone_surrogate`` passes numbers over and spells only the reported field's path; it answers
as the plain walk it replaced did (kept here as the reference), on any decoded JSON."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.services.router.openai_fields import lone_surrogate, unicode_problem


def reference(value: Any) -> tuple[str, str] | None:
    """The walk before: every item pushed with its path spelled out."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            problem = unicode_problem(item)
            if problem is not None:
                return path, problem
        elif isinstance(item, dict):
            for key, inner in reversed(item.items()):
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and unicode_problem(key) is not None:
                    return path or "body", f"has a key that {unicode_problem(key)}"
                pending.append((where, inner))
        elif isinstance(item, list):
            pending.extend((f"{path}.{i}" if path else str(i), inner) for i, inner in reversed(list(enumerate(item))))
    return None


TEXT = st.sampled_from(["", "ok", "a\ud800b", "\udfff", "é", "x.y"])
LEAF = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(), TEXT)
JSON = st.recursive(LEAF, lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(TEXT, inner, max_size=4)), max_leaves=40)


@settings(max_examples=500, deadline=None)
@given(JSON)
def test_the_walk_answers_as_the_plain_walk_did(value: Any) -> None:
    assert lone_surrogate(value) == reference(value)
