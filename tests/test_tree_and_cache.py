"""Tree construction invariants and KV compaction (base and draft caches equal a full recompute)."""

import pytest
import torch
from tiny import random_draft, tiny_base
from transformers import DynamicCache

from eagle.decoding.draft import Drafter
from eagle.decoding.generate import Budget, TreeSpec, eagle_rounds
from eagle.decoding.tree import MC_SIM_7B_63, DraftTree, TreeDraft
from eagle.decoding.verify import SamplingParams, TokenPicker
from eagle.kernels import panel_kernel
from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import read_checkpoint
from eagle.models.kv_cache import TreeKVCache


def make_model(tmp_path, eagle3=False, arch="llama", **over):
    base = tiny_base(arch, **over)
    config, state = read_checkpoint(random_draft(base, str(tmp_path / "d"), eagle3=eagle3, draft_vocab=12 if eagle3 else None))
    return EaModel(base, load_head(base, config, state), None)


def primed_drafter(model, prompt_len=9):
    """A drafter that has committed a random prompt's features, as after prefill."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (1, prompt_len))
    cache = model.base.new_cache(64)
    _, features = model.base.forward(ids, torch.arange(prompt_len)[None], cache)
    drafter = Drafter(model.ea_layer, model.base.lm_head, 256)
    drafter.commit(features, ids[0, 1:].tolist() + [3])
    return drafter


def host(draft: TreeDraft) -> DraftTree:
    """The tree as the host reads it; the depths and ancestor mask computed on the device must agree with it."""
    tree, _ = draft.read()
    assert draft.depth.tolist() == tree.depth, "device depths = depths implied by the parents"
    assert torch.equal(draft.ancestors, tree.ancestor_mask()), "device ancestor mask = the parents' closure"
    return tree


def assert_well_formed(tree: DraftTree):
    mask = tree.ancestor_mask()
    for i in range(1, len(tree)):
        p = tree.parents[i]
        assert p < i, "parents precede children"
        expected = mask[p].clone()
        expected[i] = True
        assert torch.equal(mask[i], expected), "mask row = parent's row + self (ancestor-closed)"
        assert tree.depth[i] == tree.depth[p] + 1 == int(mask[i].sum()) - 1
    for kids in tree.children:
        assert len(kids) == len(set(kids)), "siblings carry distinct tokens"


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
def test_dynamic_tree_is_ancestor_closed_with_total_token_nodes(tmp_path, eagle3):
    model = make_model(tmp_path, eagle3)
    drafter = primed_drafter(model)
    for total, depth, k in [(60, 7, 10), (12, 3, 4), (5, 1, 2), (30, 6, 3)]:
        tree = host(drafter.dynamic_tree(3, total, depth, k))
        assert len(tree) == min(total, 1 + k + depth * k * k)
        assert max(tree.depth) <= depth + 1
        assert_well_formed(tree)
        assert drafter.cache.length == 9, "tree expansion never commits to the draft cache"


def test_dynamic_tree_stays_closed_when_children_tie_with_parents(tmp_path):
    """A draft certain of its next token gives children the parent's exact score; ties must keep parents."""
    model = make_model(tmp_path, eagle3=True)
    with torch.no_grad():
        model.ea_layer.lm_head.weight.zero_()
        model.ea_layer.lm_head.weight[5].fill_(1e4)  # log-prob 0 for draft id 5, -inf-ish elsewhere
    drafter = primed_drafter(model)
    tree = host(drafter.dynamic_tree(3, 40, 7, 4))
    assert_well_formed(tree)
    assert max(tree.depth) == 8  # the certain chain runs the full depth


def test_dynamic_tree_drafts_no_level_it_cannot_keep(tmp_path, monkeypatch):
    """n nodes keep depths <= n - 1 (a kept node brings its ancestors): deeper levels are not drafted."""
    model = make_model(tmp_path, eagle3=True)
    drafter = primed_drafter(model)
    levels = []
    run = drafter._run  # a level's head step: its nodes sit at the position committed + level - 1

    def recorded(hidden, ids, positions, mask, write_at):
        levels.append(int(positions[0, 0]) - drafter.cache.length + 1)
        return run(hidden, ids, positions, mask, write_at)

    monkeypatch.setattr(drafter, "_run", recorded)
    tree = host(drafter.dynamic_tree(3, 4, 6, 2))
    assert levels == [1, 2]  # children of depth 2 and 3
    assert (tree.tokens, tree.parents) == (lambda t: (t.tokens, t.parents))(host(drafter.dynamic_tree(3, 4, 2, 2)))
    with torch.no_grad():  # a certain draft: the chain reaches the deepest depth 4 nodes can hold
        model.ea_layer.lm_head.weight.zero_()
        model.ea_layer.lm_head.weight[5].fill_(1e4)
    assert max(host(primed_drafter(model).dynamic_tree(3, 4, 6, 2)).depth) == 3


def test_static_tree_has_the_reference_shape(tmp_path):
    model = make_model(tmp_path)
    tree = host(primed_drafter(model).static_tree(3, MC_SIM_7B_63))
    assert len(tree) == 26 and max(tree.depth) == 5
    assert_well_formed(tree)
    assert sum(d == 1 for d in tree.depth) == 4


@pytest.mark.parametrize("prompt_len", [6, 1100], ids=["short", "long"])
@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
def test_caches_after_compaction_equal_a_full_recompute(tmp_path, eagle3, prompt_len):
    model = make_model(tmp_path, eagle3, arch="qwen2", max_position_embeddings=2048)
    prompt = torch.tensor([[4, 9, 2, 7, 7, 3]]).repeat(1, -(-prompt_len // 6))[:, :prompt_len]
    cache = model.base.new_cache(prompt_len + 128)
    drafter = Drafter(model.ea_layer, model.base.lm_head, prompt_len + 256)
    budget = Budget(prompt.shape[1], 30, 2048, set())
    with torch.inference_mode():  # as EaModel runs it
        rounds = list(eagle_rounds(model.base, drafter, prompt, TokenPicker(SamplingParams()), budget, TreeSpec(), cache))
    tokens = prompt[0].tolist() + [t for r in rounds for t in r.tokens]
    assert sum(r.accepted for r in rounds) > 0, "no acceptance: compaction was not exercised"
    committed = len(tokens) - 1  # the last token is the pending root
    assert cache.length >= committed  # a path cut by max_new_tokens may leave extra accepted rows

    fresh = DynamicCache()
    ids = torch.tensor([tokens[:committed]])
    with torch.no_grad():
        _, features = model.base.forward(ids, torch.arange(committed)[None], fresh_cache := model.base.new_cache(committed))
        model.base_model(ids, past_key_values=fresh, use_cache=True)
    for ours, ref in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(ours.keys[:, :, :committed], ref.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values[:, :, :committed], ref.values, atol=1e-5, rtol=1e-4)

    # The draft's committed cache and last output equal a draft run over the same committed positions
    # (the draft skips feeding the final round: generation stopped there).
    assert fresh_cache.length == committed
    n = drafter.cache.length
    assert prompt.shape[1] < n < committed
    replay = Drafter(model.ea_layer, model.base.lm_head, prompt_len + 256)
    replay.commit(features[:n], tokens[1 : n + 1])
    torch.testing.assert_close(drafter.cache.layers[0].keys[:, :, :n], replay.cache.layers[0].keys[:, :, :n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(drafter.last, replay.last, atol=1e-5, rtol=1e-4)


def test_the_layers_share_one_length_that_a_pass_advances_once():
    """Every layer of a pass writes at the cache's length and the last layer's update advances it (one int for the
    compiled graphs to take, not one a layer); transformers' crop, which calls every layer's, removes rows once."""
    cache = TreeKVCache(num_layers=3, capacity=8)
    states = torch.arange(5.0).view(1, 1, 5, 1)
    for layer in cache.layers:  # a pass of 3 rows after none
        assert cache.length == 0
        keys, values = layer.update(states[:, :, :3], -states[:, :, :3])
        assert keys[0, 0, :, 0].tolist() == [0, 1, 2] and values[0, 0, :, 0].tolist() == [0, -1, -2]
    assert cache.length == 3 and all(layer.get_seq_length() == 3 for layer in cache.layers)
    for layer in cache.layers:  # the next pass writes after them
        keys, _ = layer.update(states[:, :, 3:], -states[:, :, 3:])
        assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    cache.crop(-2)
    assert cache.length == 3 and all(layer.get_seq_length() == 3 for layer in cache.layers)


def test_a_write_at_positions_equals_a_write_from_a_start_and_reads_its_span(tmp_path):
    """One cache for the base and the draft head, written one way: rows from an int start (keys read up to the last
    row) or at a tensor of positions (keys read over a static span; a zeroed cache's rows past the written ones are
    zero, not garbage). The base's update writes at the cache's length, or at `write_positions` over `read_span`."""
    model = make_model(tmp_path)
    assert type(model.base.new_cache(8)) is type(model.ea_layer.new_cache(8)) is TreeKVCache
    ks, vs = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    start = TreeKVCache(1, 16).allocate(2, 4, torch.float32, "cpu").layers[0]
    at = TreeKVCache(1, 16, zeroed=True).allocate(2, 4, torch.float32, "cpu").layers[0]
    k1, v1 = start.write(ks, vs, 5)
    k2, v2 = at.write(ks, vs, torch.arange(5, 8), 12)
    assert k1.shape[2] == 8 and k2.shape[2] == 12
    assert torch.equal(k1[:, :, 5:], k2[:, :, 5:8]) and torch.equal(v1[:, :, 5:], v2[:, :, 5:8])
    assert not k2[:, :, 8:].any() and not v2[:, :, 8:].any()
    with pytest.raises(RuntimeError, match="KV cache overflow.*max_length"):
        start.write(ks, vs, 14)

    cache = TreeKVCache(num_layers=2, capacity=16, zeroed=True)
    cache.length, cache.write_positions, cache.read_span = 5, torch.arange(9, 12), 12
    for layer in cache.layers:
        assert layer.get_mask_sizes(3) == (12, 0)
        keys, _ = layer.update(ks, vs)
        assert keys.shape[2] == 12 and torch.equal(keys[:, :, 9:12], ks)
    assert cache.length == 5  # the runner keeps the length of position-written passes


@pytest.fixture(params=["per layer", "one call"])
def compaction(request, monkeypatch):
    """TreeKVCache.compact's two ways: copies per layer, or every layer in one call of the kernel library's
    `compact_rows` (CPU buffers, where the library is built)."""
    one_call = request.param == "one call"
    if one_call and not panel_kernel.available():
        pytest.skip(f"panel kernel: {panel_kernel._state.get('why')}")
    monkeypatch.setattr(panel_kernel, "loaded", lambda: one_call)
    return request.param


def test_compact_moves_kept_rows_into_the_prefix(compaction):
    cache = TreeKVCache(num_layers=2, capacity=10)
    states = torch.arange(8.0).view(1, 1, 8, 1)
    for layer in cache.layers:
        layer.update(states, -states)
    cache.compact([3, 5, 6], start=3)  # keep row 3 (root) and rows 5, 6 of the tree
    for layer in cache.layers:
        assert layer.get_seq_length() == 6
        assert layer.keys[0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 6]
        assert layer.values[0, 0, :6, 0].tolist() == [0, -1, -2, -3, -5, -6]


def test_compact_copies_only_the_rows_that_moved(monkeypatch):
    from eagle.models.kv_cache import PreallocatedLayer

    monkeypatch.setattr(panel_kernel, "loaded", lambda: False)  # the copies per layer, counted here

    cache = TreeKVCache(num_layers=2, capacity=12)
    states = torch.arange(9.0).view(1, 1, 9, 1)
    for layer in cache.layers:
        layer.update(states, -states)
    copies = []
    move = PreallocatedLayer.compact
    monkeypatch.setattr(PreallocatedLayer, "compact", lambda self, keep, start: copies.append(
        (keep.tolist(), start)) or move(self, keep, start))  # fmt: skip
    cache.compact([3, 4, 5], start=3)  # a chain's path: its rows are where they belong
    assert copies == [] and all(layer.get_seq_length() == 6 for layer in cache.layers)
    for layer in cache.layers:
        layer.update(states[:, :, 6:9], -states[:, :, 6:9])  # a tree after the 6 kept rows: nodes 6, 7, 8
    cache.compact([6, 8], start=6)  # the root in place, the node at row 8 moves to 7
    assert copies == [([8], 7)] * 2
    for layer in cache.layers:
        assert layer.get_seq_length() == 8
        assert layer.keys[0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 8]


def test_compact_in_one_call_equals_the_copies_per_layer(monkeypatch):
    """Random trees' paths over several layers, heads and contexts: the kernel's moves leave every buffer bit for
    bit as the per-layer copies do, in one call; rows past the kept ones are left as they were."""
    if not panel_kernel.available():
        pytest.skip(f"panel kernel: {panel_kernel._state.get('why')}")
    calls = []
    op = torch.ops.eagle.compact_rows
    monkeypatch.setattr(torch.ops.eagle, "compact_rows", lambda *a: calls.append(a) or op(*a), raising=False)
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        start, nodes = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(2, 17, (1,), generator=g))
        tree_rows = torch.randperm(nodes, generator=g)[: int(torch.randint(1, nodes + 1, (1,), generator=g))]
        keep = sorted(start + int(i) for i in tree_rows)
        caches = []
        for one_call in (False, True):
            monkeypatch.setattr(panel_kernel, "loaded", lambda one_call=one_call: one_call)
            cache = TreeKVCache(num_layers=3, capacity=64)
            states = torch.randn(1, 3, start + nodes, 8, generator=torch.Generator().manual_seed(trial))
            for layer in cache.layers:
                layer.update(states, states * 2)
            cache.compact(keep, start)
            caches.append(cache)
        assert caches[0].length == caches[1].length == start + len(keep)
        written = start + nodes  # the buffers' rows past these were never written (uninitialised memory)
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(a.keys[:, :, :written], b.keys[:, :, :written])
            assert torch.equal(a.values[:, :, :written], b.values[:, :, :written])
    assert 0 < len(calls) <= 20 and all(len(c[0]) == 6 for c in calls)  # one call a compaction: 3 layers x (K, V)


def test_auto_tree_size_is_timed_and_stays_lossless(tmp_path):
    from tiny import save_base

    from eagle.model.ea_model import AUTO_TREE_SIZES

    base = tiny_base("llama")
    save_base(base, str(tmp_path / "base"))
    draft = random_draft(base, str(tmp_path / "d"))
    model = EaModel.from_pretrained(str(tmp_path / "base"), draft, total_token=-1, device_map="auto")
    assert model.tree.total_token in AUTO_TREE_SIZES
    ids = torch.tensor([[3, 4, 5]])
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                        min_new_tokens=24, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert model.eagenerate(ids, max_new_tokens=24, stop_token_ids=[]).tolist() == ref.tolist()
