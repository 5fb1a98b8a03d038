"""EAGLE-3 features are the base's hidden states 2, L // 2 and L - 3 (the inputs of those layers), as transformers
returns them with `output_hidden_states=True`: checked on bases deep enough for three distinct taps."""

import pytest
import torch
from tiny import tiny_base

from eagle.models.base import BaseModel, eagle3_feature_layers


@pytest.mark.parametrize("layers", [8, 12])
def test_eagle3_features_are_hidden_states_2_mid_and_l_minus_3(layers):
    model = tiny_base("llama", layers=layers)
    base = BaseModel(model, eagle3=True)
    low, mid, high = eagle3_feature_layers(layers)
    assert len({low, mid, high}) == 3 and (low, mid, high) == (2, layers // 2, layers - 3)
    ids = torch.tensor([[3, 9, 4, 1, 7, 7, 2, 12, 5]])
    with torch.no_grad():
        hidden_states = model(ids, output_hidden_states=True).hidden_states  # L + 1 entries: embeddings, layer outputs
        _, features = base.forward(ids[:, :5], torch.arange(5)[None], cache := base.new_cache(16))
        _, later = base.forward(ids[:, 5:], torch.arange(5, 9)[None], cache)  # continued from the cache
    expected = torch.cat([hidden_states[i][0] for i in (low, mid, high)], dim=-1)  # [9, 3H]
    torch.testing.assert_close(torch.cat([features, later]), expected, atol=1e-5, rtol=1e-4)
    # The three blocks differ: a tap repeated or shifted by one layer would not match all of them.
    H = model.config.hidden_size
    blocks = expected.split(H, dim=-1)
    assert not torch.allclose(blocks[0], blocks[1]) and not torch.allclose(blocks[1], blocks[2])
    for i in (low, mid, high):
        assert not torch.allclose(hidden_states[i][0], hidden_states[i + 1][0])
