"""Self-distillation: batched first-reply regeneration gives each conversation the reply it gets alone."""

from chat_fixtures import SMOLLM2_TEMPLATE, byte_tokenizer
from tiny import tiny_base

from eagle.train.masks import HFTemplate
from eagle.train.regen import opening, regenerate_first_turns, regenerate_replies


def _setup():
    tok = byte_tokenizer("<s>", "<|im_end|>")
    # seed 5: some replies end with <|im_end|> within the budget, others run out of it
    base = tiny_base(vocab=len(tok), layers=2, seed=5, max_position_embeddings=1024).float()
    return tok, base, HFTemplate(tok, SMOLLM2_TEMPLATE)


def test_batched_first_replies_equal_one_at_a_time():
    tok, base, template = _setup()
    conversations = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"},
         {"role": "user", "content": "more"}, {"role": "assistant", "content": "old 2"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is a tree? " * 3}],
        [{"role": "user", "content": "x" * 300}],  # leaves fewer than 8 tokens for a reply: skipped
        [{"role": "assistant", "content": "no user turn before me"}],  # nothing to answer: skipped
        [{"role": "user", "content": "Write a poem about the sea."}, {"role": "assistant", "content": "old"}],
        [{"role": "user", "content": "ok"}],
    ]  # fmt: skip
    max_len, new = 300, 24
    batched = regenerate_first_turns(base, tok, template, conversations, max_len, new, batch_size=2)
    assert batched[2] is None and batched[3] is None
    for conv, got in zip(conversations, batched):
        if got is None:
            continue
        alone = regenerate_replies(base, tok, template, opening(conv) + [{"role": "assistant", "content": ""}],
                                   max_len, new)  # fmt: skip
        assert got == alone
        messages, _ = got
        assert messages[:-1] == opening(conv) and messages[-1]["role"] == "assistant"  # later turns dropped
    truncated = [got[1] for got in batched if got is not None]
    assert any(truncated) and not all(truncated)  # both endings were exercised
