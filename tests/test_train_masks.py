"""Loss masks derived from real chat templates: the masked tokens are exactly the replies + end-of-turn tokens."""

import pytest
import torch
from chat_fixtures import SMOLLM2_TEMPLATE, byte_tokenizer

from eagle.train.masks import FastChatTemplate, HFTemplate, TemplateError, encode_conversation

# meta-llama/Meta-Llama-3-8B-Instruct's chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "What is 2+2? Answer briefly."},
    {"role": "assistant", "content": "It is 4.\n\nAnything else? (café)"},
    {"role": "user", "content": "Say hi to the assistant: ASSISTANT"},
    {"role": "assistant", "content": "  Hi!  "},
]


def masked_text(tok, ids, mask) -> str:
    return tok.decode(ids[mask].tolist())


def check(tok, template, conversation, expected_replies: list[str], eot: str):
    ids, mask = encode_conversation(tok, template, conversation)
    assert masked_text(tok, ids, mask) == "".join(r + eot for r in expected_replies)
    # Each reply is one contiguous run ending with the end-of-turn token; nothing else is masked.
    runs = torch.diff(torch.cat([torch.tensor([0]), mask.int(), torch.tensor([0])])).eq(1).sum()
    assert runs == len(expected_replies)
    unmasked = tok.decode(ids[~mask].tolist())
    for m in conversation:
        if m["role"] != "assistant":
            assert m["content"].strip() in unmasked
    return ids, mask


def test_smollm2_template():
    tok = byte_tokenizer("<|im_start|>", "<|im_end|>")
    template = HFTemplate(tok, SMOLLM2_TEMPLATE)
    ids, mask = check(tok, template, CONVERSATION, [m["content"] for m in CONVERSATION[1::2]], "<|im_end|>")
    text = tok.decode(ids.tolist())
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "SmolLM" not in masked_text(tok, ids, mask)


def test_smollm2_template_with_system_and_truncation():
    tok = byte_tokenizer("<|im_start|>", "<|im_end|>")
    template = HFTemplate(tok, SMOLLM2_TEMPLATE)
    conv = [{"role": "system", "content": "Be terse."}] + CONVERSATION
    check(tok, template, conv, [m["content"] for m in CONVERSATION[1::2]], "<|im_end|>")
    ids, mask = encode_conversation(tok, template, conv, max_len=40)
    assert len(ids) == len(mask) == 40


def test_llama3_template_trims_content():
    tok = byte_tokenizer("<|begin_of_text|>", "<|eot_id|>")
    template = HFTemplate(tok, LLAMA3_TEMPLATE)
    ids, _ = check(tok, template, CONVERSATION, [m["content"].strip() for m in CONVERSATION[1::2]], "<|eot_id|>")
    assert tok.decode(ids[:1].tolist()) == "<|begin_of_text|>"


def test_vicuna_fastchat():
    pytest.importorskip("fastchat")
    tok = byte_tokenizer("<s>", "</s>")
    template = FastChatTemplate("vicuna_v1.1")
    ids, mask = check(tok, template, CONVERSATION, [m["content"] for m in CONVERSATION[1::2]], "</s>")
    assert ids[0] == tok.bos_token_id and not mask[0]  # fastchat prompts get the tokenizer's bos
    assert "A chat between a curious user" in tok.decode(ids.tolist())


def test_llama2_fastchat():
    pytest.importorskip("fastchat")
    tok = byte_tokenizer("<s>", "</s>")
    template = FastChatTemplate("llama-2", system="You are helpful.")
    ids, mask = encode_conversation(tok, template, CONVERSATION)
    # llama-2 writes "reply </s><s>[INST]": the reply, then (after an unmasked space) its </s>; never the <s>.
    assert masked_text(tok, ids, mask) == "".join(m["content"] + "</s>" for m in CONVERSATION[1::2])


def test_template_without_verbatim_content_is_rejected():
    tok = byte_tokenizer("<s>", "</s>")
    template = HFTemplate(tok, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}")
    with pytest.raises(TemplateError):
        encode_conversation(tok, template, CONVERSATION)


def test_real_smollm2_tokenizer():
    from eagle.default_model import MARKER, converted_model_dir

    folder = converted_model_dir()
    if not (folder / MARKER).is_file():
        pytest.skip("SmolLM2 not converted in the cache")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    # Real BPEs merge a reply's leading spaces with the template's newline before it, so no leading spaces here.
    conv = [dict(m, content=m["content"].lstrip()) for m in CONVERSATION]
    check(tok, HFTemplate(tok), conv, [m["content"] for m in conv[1::2]], "<|im_end|>")
