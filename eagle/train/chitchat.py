"""The Chit-Chat Challenge's human conversations (`chitchat-dataset` on PyPI, MIT) as chat messages for training.

Its dataset.json maps a conversation id to {"messages": [[{"sender", "text", ...}, ...], ...]}: each message is a
list of utterances by one sender. The first sender becomes the user, the other the assistant; a message's
utterances, and consecutive messages of one sender, are joined by newlines into one turn. Conversations with no assistant turn are left out; the
replies are the data's own until `regen.regenerate_all_turns` writes the base's.
"""

from __future__ import annotations

import json
import os


def load_chitchat(path: str | os.PathLike | None = None, limit: int | None = None) -> list[list[dict]]:
    """Up to `limit` conversations as message lists ({"role": "user"|"assistant", "content"}), in the file's order.
    `path` defaults to the pinned wheel's dataset.json (fetched with pip on first use)."""
    if path is None:
        from eagle.fetch import CHITCHAT, fetch_wheel_member

        path = fetch_wheel_member(CHITCHAT)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    conversations = []
    for record in data.values():
        turns = [m for m in record.get("messages", []) if m]
        first = turns[0][0].get("sender") if turns else None
        messages = []
        for message in turns:
            text = "\n".join(u["text"].strip() for u in message if u.get("text", "").strip())
            role = "user" if message[0].get("sender") == first else "assistant"
            if not text:
                continue
            if messages and messages[-1]["role"] == role:  # one sender twice in a row: one turn
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": role, "content": text})
        if messages and messages[-1]["role"] == "user":
            messages.pop()
        if len(messages) >= 2:
            conversations.append(messages)
            if limit is not None and len(conversations) >= limit:
                break
    return conversations
