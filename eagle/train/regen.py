"""Self-distillation: replace the data's assistant replies by the base model's own.

The draft is scored against the base's greedy tokens, so replies the base wrote itself are the text it will be
asked to predict at inference; peers report higher acceptance from them than from the data's original replies.

Two ways, both greedy by default:
- `regenerate_replies`: every turn of one conversation, each reply conditioned on the replies regenerated
  before it (one `generate` call per turn);
- `regenerate_first_turns`: many conversations at once, keeping only their opening (the messages up to the first
  reply) and regenerating that first reply, in left-padded batches (several times the throughput on CPU).
"""

from __future__ import annotations

import torch

from eagle.model.ea_model import stop_token_ids


def _prompt_ids(tokenizer, template, messages: list[dict]) -> torch.Tensor:
    """The generation prompt after `messages`, as the template tokenizes it. -> [T] long"""
    prompt = template.render(messages, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if template.adds_bos and tokenizer.bos_token_id is not None:
        ids = torch.cat([torch.tensor([tokenizer.bos_token_id]), ids])
    return ids


def _sampling(temperature: float) -> dict:
    if temperature > 0:
        return {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    return {"do_sample": False}


def _reply_text(tokenizer, generated: list[int], stops: set[int]) -> tuple[str, bool]:
    """Generated ids -> (reply text up to the first stop token, cut = no stop token was produced)."""
    cut = next((i for i, t in enumerate(generated) if t in stops), len(generated))
    return tokenizer.decode(generated[:cut], skip_special_tokens=True), cut == len(generated)


def regenerate_replies(model, tokenizer, template, messages: list[dict], max_len: int, max_new_tokens: int,
                       temperature: float = 0.0) -> tuple[list[dict], bool]:  # fmt: skip
    """Replace each assistant reply by the base's own, turn by turn. Stops at the first turn that does not fit
    in `max_len`.

    Returns (messages, truncated): truncated = the last reply was cut by the length budget, so the end-of-turn
    token the template adds after it is not one the base produced."""
    stop_set = stop_token_ids(tokenizer)
    stops = sorted(stop_set)
    device = model.get_input_embeddings().weight.device
    out, truncated = [], False
    for m in messages:
        if m["role"] != "assistant":
            out.append(m)
            continue
        ids = _prompt_ids(tokenizer, template, out)[None]  # [1, T]
        budget = min(max_new_tokens, max_len - ids.shape[1])
        if budget < 8:
            break
        gen = model.generate(
            ids.to(device), attention_mask=torch.ones_like(ids).to(device), max_new_tokens=budget,
            eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0, **_sampling(temperature),
        )[0, ids.shape[1]:].tolist()  # fmt: skip
        text, cut = _reply_text(tokenizer, gen, stop_set)
        if not text.strip():
            break
        out.append({"role": "assistant", "content": text})
        if cut:  # ran out of room: nothing after this turn fits
            truncated = True
            break
    while out and out[-1]["role"] != "assistant":
        out.pop()
        truncated = False
    return out, truncated


def opening(messages: list[dict]) -> list[dict]:
    """The messages before the first assistant reply (system and user turns)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return list(messages[:first])


def prompt_of(messages: list[dict]) -> list[dict]:
    """What a reply is generated for: the whole conversation when it ends with a user turn (a later turn, after
    earlier replies), else its opening."""
    return list(messages) if messages and messages[-1]["role"] == "user" else opening(messages)


@torch.inference_mode()
def regenerate_first_turns(model, tokenizer, template, conversations: list[list[dict]], max_len: int,
                           max_new_tokens: int, temperature: float = 0.0, batch_size: int = 32,
                           ) -> list[tuple[list[dict], bool] | None]:  # fmt: skip
    """Each conversation's prompt (`prompt_of`: its opening, or the whole conversation when it ends with a user
    turn) plus the base's own reply, generated `batch_size` conversations at a
    time. Prompts are sorted by length so a batch pads little; rows are left-padded and their positions come from
    the attention mask, so a row's greedy reply is the one it gets alone (up to float rounding across batch
    shapes).

    Returns, per conversation in the given order, (messages, truncated) as `regenerate_replies` does, or None when
    its opening does not leave 8 tokens for a reply within `max_len`, or the reply is empty."""
    stop_set = stop_token_ids(tokenizer)
    stops = sorted(stop_set)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
    device = model.get_input_embeddings().weight.device
    openings = [prompt_of(c) for c in conversations]
    prompts = [_prompt_ids(tokenizer, template, o) if o and o[-1]["role"] == "user" else None for o in openings]
    results: list[tuple[list[dict], bool] | None] = [None] * len(conversations)
    order = sorted((i for i, p in enumerate(prompts) if p is not None and max_len - len(p) >= 8),
                   key=lambda i: len(prompts[i]))  # fmt: skip
    for b in range(0, len(order), batch_size):
        rows = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [B, T] left-padded
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]) :] = prompts[i]
            attention[r, width - len(prompts[i]) :] = 1
        budget = min(max_new_tokens, max_len - width)  # >= 8: every row's prompt leaves 8 tokens
        gen = model.generate(
            ids.to(device), attention_mask=attention.to(device), max_new_tokens=budget,
            eos_token_id=stops or None, pad_token_id=pad, **_sampling(temperature),
        )[:, width:].tolist()  # fmt: skip
        for r, i in enumerate(rows):
            room = max_len - len(prompts[i])
            text, cut = _reply_text(tokenizer, gen[r][:room], stop_set)
            if text.strip():
                results[i] = (openings[i] + [{"role": "assistant", "content": text}], cut)
    return results


def regenerate_all_turns(model, tokenizer, template, conversations: list[list[dict]], max_len: int,
                         max_new_tokens: int, batch_size: int = 256, temperature: float = 0.0, seed: int = 0,
                         ) -> list[tuple[list[dict], bool] | None]:  # fmt: skip
    """`regenerate_replies` for many conversations at once through the batched generator (batch_generate.py): turn
    by turn, every conversation still going gets its next reply written on its conversation so far, `batch_size`
    rows at a time; a conversation that ends with a user turn (an opening, a written prompt) gets a reply to it
    too. A conversation ends after its last reply, at the first turn whose prompt leaves fewer than
    `max_new_tokens` tokens within `max_len`, or at a reply cut by the budget (then truncated) or empty.

    Returns per conversation (messages, truncated) as `regenerate_replies` does, or None when not one reply fit."""
    from .batch_generate import generate_all

    stop_set = stop_token_ids(tokenizer)
    done: list[list[dict]] = [[] for _ in conversations]  # messages so far, replies the base's own
    truncated = [False] * len(conversations)
    position = [0] * len(conversations)  # the next message of each conversation to take
    going = list(range(len(conversations)))
    turn = 0
    while going:
        asks = []  # (conversation, prompt ids) of the conversations whose next reply is written now
        for i in going:
            messages = conversations[i]
            while position[i] < len(messages) and messages[position[i]]["role"] != "assistant":
                done[i].append(messages[position[i]])
                position[i] += 1
            # at the data's next reply, or at the end: a conversation ending with a user turn gets one reply more
            if not done[i] or done[i][-1]["role"] != "user":
                continue
            position[i] += 1  # past the data's reply, which the base's replaces
            ids = _prompt_ids(tokenizer, template, done[i]).tolist()
            if len(ids) + max_new_tokens <= max_len:
                asks.append((i, ids))
        if not asks:
            break
        outs = generate_all(model, [ids for _, ids in asks], batch_size, max_new_tokens, stop_set,
                            temperature=temperature, seed=seed + turn)  # fmt: skip
        going = []
        for (i, _), out in zip(asks, outs, strict=True):
            text, cut = _reply_text(tokenizer, out, stop_set)
            if not text.strip():
                continue
            done[i].append({"role": "assistant", "content": text})
            truncated[i] = cut
            if not cut:
                going.append(i)
        turn += 1
    results: list[tuple[list[dict], bool] | None] = []
    for i, messages in enumerate(done):
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        has_reply = any(m["role"] == "assistant" for m in messages)
        results.append((messages, truncated[i]) if has_reply else None)
    return results
