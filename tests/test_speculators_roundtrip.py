"""This project's EAGLE-3 heads and the `speculators` package (vllm-project/speculators 0.9.0), both directions.

The fixture (tests/fixtures/speculators_eagle3/, made by its make_fixture.py; README.md there says how) holds heads
written by this project's exporter (`ours/`), the same heads after the package's own converter (`speculators
convert`) and, for the input-norm switches, after the package's own model re-saved them (`speculators/`), and what
the package computed from each `speculators/` folder after loading it with its own loader
(`SpeculatorModel.from_pretrained`, the tiny base as verifier): the first draft step on fixed inputs
(`expected.safetensors`). The package is not installed here (it pins an older transformers): its numbers are
recorded, and these tests hold this project's loader to them.

- our exported head, loaded by our loader, computes what the package computed from its converted copy;
- the package's conversion kept every weight (only midlayer.* -> layers.0.*);
- the package-written folders, loaded by our loader, compute what the package computed, switch by switch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_base

from eagle.model.ea_model import load_head
from eagle.models.checkpoint import read_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "speculators_eagle3"
EXPECTED = load_file(FIXTURE / "expected.safetensors")
META = json.loads((FIXTURE / "expected.json").read_text())
VARIANTS = list(META["variants"])  # plain, norm_before_residual, norm_output, norm_before_fc, fc_norm
OURS = {v: META["variants"][v]["source"] for v in VARIANTS}  # which ours/ head each was made from
ATOL = 1e-5


@pytest.fixture(scope="module")
def base():
    """The verifier of the fixture: tiny_base with the same seed and sizes (make_fixture.py), with the stored
    embedding (the one base weight an EAGLE-3 head uses) so the numbers never depend on transformers' init."""
    model = tiny_base("llama", seed=0, vocab=64, layers=8)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(load_file(FIXTURE / "base_embed.safetensors")["embed_tokens"])
    return model


def first_step(head, base):
    """Our head on the fixture's inputs: (the state it feeds back, its draft-vocabulary logits)."""
    feats, ids, pos = (EXPECTED[f"inputs.{k}"] for k in ("features", "input_ids", "position_ids"))
    n = ids.shape[1]
    mask = torch.zeros(1, 1, n, n).masked_fill(torch.ones(n, n).triu(1).bool(), torch.finfo(torch.float32).min)
    with torch.no_grad():
        out = head(feats, ids, pos, mask, head.new_cache(n + 3), 0)
        return out, head.logits(out, base.get_output_embeddings())


def check_against_package(head, base, variant):
    out, logits = first_step(head, base)
    diffs = {
        "fed_back": (out - EXPECTED[f"{variant}.fed_back"]).abs().max().item(),
        "logits": (logits - EXPECTED[f"{variant}.logits"]).abs().max().item(),
    }
    assert max(diffs.values()) < ATOL, f"{variant}: max abs diff to the speculators package {diffs}"
    assert torch.equal(logits.argmax(-1), EXPECTED[f"{variant}.logits"].argmax(-1))


def test_the_fixture_base_is_tiny_base_bit_for_bit():
    """make_fixture.py saved tiny_base(seed 0) as the verifier; the tests rebuild it the same way."""
    built = tiny_base("llama", seed=0, vocab=64, layers=8).get_input_embeddings().weight
    assert torch.equal(built, load_file(FIXTURE / "base_embed.safetensors")["embed_tokens"])


@pytest.mark.parametrize("source", sorted(set(OURS.values())))
def test_our_exported_head_computes_what_the_package_computes_from_its_conversion(base, source):
    """ours/<x> (this project's exporter) loaded by this project's loader == the package's numbers for the
    folder its converter made from ours/<x> (no switch given to the converter)."""
    config, state = read_checkpoint(str(FIXTURE / source))
    head = load_head(base, config, state)
    variant = next(v for v in VARIANTS if OURS[v] == source and not META["variants"][v]["algorithm_kwargs"])
    check_against_package(head, base, variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_package_conversion_keeps_every_weight(variant):
    ours = load_file(FIXTURE / OURS[variant] / "model.safetensors")
    theirs = load_file(FIXTURE / "speculators" / variant / "model.safetensors")
    theirs.pop("embed_tokens.weight", None)  # a re-saved model stores the verifier's embedding
    assert sorted(theirs) == sorted(k.replace("midlayer.", "layers.0.") for k in ours)
    for k, v in ours.items():
        assert torch.equal(theirs[k.replace("midlayer.", "layers.0.")], v), k


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_speculators_written_head_loads_and_computes_what_the_package_computes(base, variant):
    """speculators/<variant> (written by the package) loaded by this project's loader == the package's numbers."""
    config, state = read_checkpoint(str(FIXTURE / "speculators" / variant))
    assert config["speculators_model_type"] == "eagle3"
    head = load_head(base, config, state)
    meta = META["variants"][variant]
    assert head.config.base_feature_layers(8) == tuple(meta["eagle_aux_hidden_state_layer_ids_resolved"])
    ours = load_file(FIXTURE / OURS[variant] / "model.safetensors")
    assert torch.equal(head.d2t, ours["d2t"]) and torch.equal(head.t2d, ours["t2d"])
    check_against_package(head, base, variant)


def test_the_switches_change_the_numbers():
    """Each switch moves the package's outputs well beyond the tolerance (norm_output: the state fed back, not the
    first logits), so the checks above tell the switches apart."""
    for variant in VARIANTS[1:]:
        moved = max((EXPECTED[f"{variant}.{k}"] - EXPECTED[f"plain.{k}"]).abs().max() for k in ("fed_back", "logits"))
        assert moved > 100 * ATOL, variant
