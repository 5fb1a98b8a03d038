"""The bandwidth floor: weight bytes a one-token step reads (tied and untied embeddings) and a measured bandwidth."""

import pytest
from tiny import tiny_base

from eagle.evaluation.floor import floor, stream_bandwidth, weight_bytes_per_token


def test_weight_bytes_count_an_untied_embedding_as_one_row():
    model = tiny_base("llama", vocab=64)  # untied: the lm_head reads all 64 rows, the embedding one row of 32
    every = sum(p.numel() for p in model.parameters()) * 4
    assert weight_bytes_per_token(model) == every - (64 - 1) * 32 * 4


def test_weight_bytes_count_a_tied_embedding_once_in_full():
    model = tiny_base("llama", vocab=64, tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert weight_bytes_per_token(model) == sum(p.numel() for p in model.parameters()) * 4


def test_floor_is_bandwidth_over_weight_bytes():
    assert stream_bandwidth(mib=8, repeats=2) > 1e8  # any machine streams more than 100 MB/s
    model = tiny_base("llama", vocab=64)
    bound = floor(model)
    assert bound["tokens_per_s"] * bound["weight_mb"] / 1e3 == pytest.approx(bound["bandwidth_gb_s"])
