"""Context drafts on the page: the characters of accepted context copies in their own shade (`<span class="ctx">`,
apart from the head's `<span class="acc">`), the new tokens' shares by source in the figures (panel, summary, /chat),
the per-session setting, and when the engine asks the model for them (eager forwards: always; compiled rounds: once
the context shape's compiled round is in, brought in by the idle work after the two-step rounds). CPU only."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from app_fixtures import one_thread, tiny_engine
from html_checks import elements

from app import precompile
from app.handlers import _settings, make_handlers, restored_conversation, summary_html
from app.highlight import LEGEND_HTML, Reply, plain_text, render, token_sources
from app.idle_work import compiled_round_steps
from app.markdown_render import BASE, CONTEXT, HEAD, TAGS, accepted_bytes, markdown_html
from app.precompile import CompileSpec, graph_name
from app.race import Lane, LaneState, pane_html
from app.session import Comparison, Pane, Settings, respond, summary
from app.stats import SHARES, RunStats, figures_html, shares_text
from eagle.decoding.context_draft import ContextStats
from eagle.decoding.generate import Round
from eagle.runtime.round_graphs import CompiledRound

SPAN = re.compile(r'<span class="(acc|ctx)">(.*?)</span>')
REPEATING = "w3 w4 w5 w6 w7 w3 w4 w5 w9 w2 w3 w4"  # the tiny model's greedy reply to it soon repeats itself


def spans(out: str) -> list[tuple[str, str]]:
    """(class, text) of every highlight span, in order."""
    return SPAN.findall(out)


class CharTokenizer:
    """Token id = a character's code point."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(map(chr, ids))


# highlighting ------------------------------------------------------------------------------------------------
def test_context_copies_render_in_the_ctx_span_and_head_drafts_in_the_acc_span():
    text = "Hello **world** and `code x` ok"
    marks = [[0, 5], [8, 13, CONTEXT], [22, 26]]  # "Hello" drafted, "world" copied, "ode " drafted
    out = markdown_html(text, marks)
    assert spans(out) == [("acc", "Hello"), ("ctx", "world"), ("acc", "ode ")]
    assert "<strong><span class=\"ctx\">world</span></strong>" in out and plain_text(out) == "Hello world and code x ok"


def test_a_highlighted_run_splits_where_its_source_changes():
    out = markdown_html("abcdefgh", [[0, 3], [3, 6, CONTEXT], [6, 8]])
    assert spans(out) == [("acc", "abc"), ("ctx", "def"), ("acc", "gh")]
    assert accepted_bytes(8, [[0, 3], [3, 6, CONTEXT]]) == bytes([HEAD] * 3 + [CONTEXT] * 3 + [BASE] * 2)


def test_html_in_a_context_copy_stays_text_and_no_other_element_appears():
    text = "<script>alert(1)</script> and <img src=x onerror=alert(2)> [x](javascript:alert(3))"
    out = markdown_html(text, [[0, len(text), CONTEXT]])
    assert "<script" not in out and "<img" not in out and not any(tag == "a" for tag, _ in elements(out))
    assert {tag for tag, _ in elements(out)} <= TAGS | {"div"}  # the reply's own <div class="eagle-tokens">
    assert {a.get("class") for tag, a in elements(out) if tag == "span"} == {"ctx"}
    assert plain_text(out) == "<script>alert(1)</script> and <img src=x onerror=alert(2)> [x](javascript:alert(3))"


def test_an_unknown_mark_source_counts_as_a_head_draft_and_never_raises():
    assert spans(markdown_html("abc", [[0, 3, 7]])) == [("acc", "abc")]
    assert spans(markdown_html("abc", [[0, 3, -1]])) == [("acc", "abc")]


def test_the_highlight_toggle_drops_both_shades():
    out = render("copied and drafted", [[0, 6, CONTEXT], [11, 18]], highlight=False)
    assert spans(out) == [] and plain_text(out) == "copied and drafted"


def test_a_reply_marks_each_token_by_its_source():
    assert token_sources(6, accepted=4, context=1) == [HEAD, HEAD, HEAD, CONTEXT, BASE, BASE]
    assert token_sources(3, accepted=2, context=2) == [CONTEXT, CONTEXT, BASE]
    reply = Reply(CharTokenizer())
    reply.add_round([ord(c) for c in "abcde"], accepted=4, context=2)  # ab head, cd copied, e the base's
    reply.add_round([ord(c) for c in "fgh"], accepted=2, context=2)  # fg copied, h the base's
    reply.add_round([ord(c) for c in "ij"], accepted=1)  # i head, j the base's
    assert reply.text == "abcdefghij"
    assert reply.marks == [[0, 2], [2, 4, CONTEXT], [5, 7, CONTEXT], [8, 9]]
    assert spans(render(reply.text, reply.marks)) == [("acc", "ab"), ("ctx", "cd"), ("ctx", "fg"), ("acc", "i")]


def test_adjacent_tokens_of_one_source_make_one_mark_and_of_two_sources_two():
    reply = Reply(CharTokenizer())
    reply.add_round([ord(c) for c in "abc"], accepted=3, context=1)  # ab head, c copied
    reply.add_round([ord(c) for c in "de"], accepted=2, context=2)  # de copied, right after c
    assert reply.marks == [[0, 2], [2, 5, CONTEXT]]


def test_the_legend_and_the_stylesheet_give_context_copies_their_own_shade():
    assert '<span class="acc">' in LEGEND_HTML and '<span class="ctx">' in LEGEND_HTML
    assert "copied from the context" in LEGEND_HTML
    css = (Path(__file__).resolve().parent.parent / "assets" / "app.css").read_text()
    rule = lambda selector: re.search(re.escape(selector) + r"\s*\{([^}]*)\}", css)  # noqa: E731
    acc, ctx = rule(".eagle-tokens .acc"), rule(".eagle-tokens .ctx")
    assert acc and ctx, "assets/app.css needs a rule for each highlight in a reply"
    background = lambda body: re.search(r"background:\s*([^;]+);", body).group(1)  # noqa: E731
    assert background(ctx.group(1)) != background(acc.group(1))


# figures -----------------------------------------------------------------------------------------------------
def test_the_shares_of_new_tokens_by_source_add_up_to_one():
    stats = RunStats()
    stats.add(Round([1, 2, 3, 4, 5], accepted=4, seconds=0.1, context=3))  # 1 head, 3 copied, 1 base
    stats.add(Round([6, 7, 8], accepted=2, seconds=0.1))  # 2 head, 1 base
    stats.add(Round([9, 10], accepted=1, seconds=0.1, stop="eos", context=1))  # 1 copied, 1 base
    d = stats.as_dict()
    assert d["draft_tokens_accepted"] == 7 and d["context_tokens_accepted"] == 4 and d["new_tokens"] == 10
    assert (d["share_from_base"], d["share_from_head"], d["share_from_context"]) == (0.3, 0.3, 0.4)
    assert sum(d[k] for k in SHARES) == pytest.approx(1.0)
    thirds = RunStats()
    thirds.add(Round([1, 2, 3], accepted=2, seconds=0.1, context=1))
    assert sum(thirds.as_dict()[k] for k in SHARES) == pytest.approx(1.0, abs=1e-3)


def test_vanilla_takes_every_token_from_the_base_and_no_tokens_have_no_shares():
    vanilla = RunStats(eagle=False)
    vanilla.add(Round([1], 0, 0.1))
    vanilla.add(Round([2], 0, 0.1, "eos"))
    assert [vanilla.as_dict()[k] for k in SHARES] == [1.0, 0.0, 0.0]
    assert [RunStats().as_dict()[k] for k in SHARES] == [None, None, None]


def test_the_figures_panel_and_the_side_by_side_summary_show_the_shares():
    stats = RunStats()
    stats.add(Round([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], accepted=4, seconds=0.1, stop="eos", context=1))
    figures = stats.as_dict()
    assert shares_text(figures) == "60% base, 30% head drafts, 10% context copies"
    page = figures_html(figures)
    assert '<span class="acc">30% head drafts</span>' in page and '<span class="ctx">10% context copies</span>' in page
    assert "60% base" in page
    vanilla = RunStats(eagle=False)
    vanilla.add(Round([1], 0, 0.1, "eos"))
    assert "context copies" not in figures_html(vanilla.as_dict())  # nothing drafted: no shares line
    c = Comparison(Pane(figures=vanilla.as_dict()), Pane(figures=figures), {})
    assert "60% base, 30% head drafts, 10% context copies" in summary_html(summary(c), True)
    for broken in ({"share_from_base": "lots"}, {k: None for k in SHARES}, {}):
        assert shares_text(broken) == "" and "context copies" not in figures_html({"mode": "eagle", **broken})


def test_a_saved_context_mark_comes_back_and_a_mark_of_no_known_source_is_dropped():
    turn = {"user": "q", "reply": "abcdef", "marks": [[0, 2], [2, 4, CONTEXT], [4, 5, 3], [5, 6, HEAD]]}
    turns, _ = restored_conversation({"version": 1, "turns": [turn]})
    assert turns[0]["marks"] == [[0, 2], [2, 4, CONTEXT]]


def test_the_race_shows_context_copies_in_their_shade_at_every_frame():
    lane = Lane("abcdef", [[0, 2], [2, 5, CONTEXT]], [[0.1, 3, 3], [0.2, 6, 6]], 30.0)
    early = pane_html(lane, LaneState(chars=3, tokens=3, t=0.1, tokens_per_s=30.0, done=False))
    assert spans(early) == [("acc", "ab"), ("ctx", "c")]
    assert spans(pane_html(lane, LaneState(6, 6, 0.2, 30.0, True))) == [("acc", "ab"), ("ctx", "cde")]


# the setting -------------------------------------------------------------------------------------------------
def test_the_setting_defaults_to_on_and_comes_last_among_the_page_settings():
    assert Settings().context_drafts is True and Settings.parse(context_drafts=None).context_drafts is True
    assert Settings.parse(context_drafts=False).context_drafts is False
    page = (0.0, 1.0, 0, 32, True, True, False, "")
    assert _settings(*page, None).context_drafts is True and _settings(*page, False).context_drafts is False


# a real reply ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with one_thread():
        engine = tiny_engine(str(tmp_path_factory.mktemp("app_context")), max_length=256)
        engine.model.context_stats = ContextStats(always=True)  # a chain wherever there is a match
        yield engine


def test_a_reply_with_context_drafts_shows_copies_in_their_shade_and_their_share(engine):
    on = list(respond(engine, REPEATING, [], Settings(max_new_tokens=60)))[-1]
    off = list(respond(engine, REPEATING, [], Settings(max_new_tokens=60, context_drafts=False)))[-1]
    assert on.done and not on.error and on.text == off.text  # lossless: the same reply either way
    f = on.figures
    assert f["context_tokens_accepted"] > 0 and f["share_from_context"] > 0, f
    assert f["share_from_context"] == pytest.approx(f["context_tokens_accepted"] / f["new_tokens"], abs=1e-4)
    assert sum(f[k] for k in SHARES) == pytest.approx(1.0, abs=1e-3)
    copied = [on.text[a:b] for a, b, *source in on.marks if source == [CONTEXT]]
    assert copied and [text for cls, text in spans(on.html) if cls == "ctx"] == copied  # each copy in its shade
    assert "% context copies" in figures_html(f)
    assert off.figures["context_tokens_accepted"] == 0 and off.figures["share_from_context"] == 0.0
    assert "ctx" not in {cls for cls, _ in spans(off.html)} and off.figures["share_from_head"] > 0


def test_the_chat_api_carries_the_shares_and_takes_the_setting(engine):
    api = make_handlers(engine)["api_chat"]
    html, text, figures = list(api(REPEATING, max_new_tokens=60))[-1]  # as a client that predates the setting
    assert figures["share_from_context"] > 0 and any(cls == "ctx" for cls, _ in spans(html))
    assert set(SHARES) | {"context_tokens_accepted", "draft_tokens_accepted"} <= set(figures)
    html_off, text_off, figures_off = list(api(REPEATING, max_new_tokens=60, context_drafts=False))[-1]
    assert text_off == text and figures_off["share_from_context"] == 0.0 and 'class="ctx"' not in html_off


# when the engine asks for them -------------------------------------------------------------------------------
@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """An engine whose model records what each stream was asked for (and decodes nothing)."""
    engine = tiny_engine(str(tmp_path))
    asked = []

    def stream(ids, **kw):
        asked.append(kw)
        yield from ()

    monkeypatch.setattr(engine.model, "stream", stream)
    return engine, asked


def asks_for_context(engine, asked, **kw) -> bool:
    list(engine.rounds([5, 6, 7], **kw))
    return asked[-1]["context_drafts"]


def fake_context_round(model) -> None:
    """A compiled round of the context shape for the head in use, as `context_rounds` puts it in use."""
    from dataclasses import replace

    from eagle.decoding.round_steps import TreeShape

    tree = replace(model.tree, chain=model.context_chain)
    shape = TreeShape.of(tree.total_token, tree.depth, tree.top_k).with_chain(tree.chain)
    model.compiled_rounds[shape] = SimpleNamespace(step=SimpleNamespace(head=model.ea_layer), shape=shape)


def test_eager_forwards_get_context_drafts_whenever_the_setting_is_on(recorded):
    engine, asked = recorded
    assert asks_for_context(engine, asked, context_drafts=True)
    assert asks_for_context(engine, asked, context_drafts=True, temperature=0.7)  # the general loop serves them
    assert not asks_for_context(engine, asked, context_drafts=False)
    assert not asks_for_context(engine, asked, context_drafts=True, eagle=False)
    assert not asks_for_context(engine, asked)  # the engine's own runs (warm-up, vanilla timing) never ask


CPU_GRAPHS = SimpleNamespace(kind="inductor", buckets=(1, 8, 16, 32))  # compiled forwards' graphs: the tiny tree with a chain fits


def test_compiled_forwards_get_context_drafts_only_once_their_round_is_compiled(recorded, monkeypatch):
    engine, asked = recorded
    monkeypatch.setattr(engine.model.base, "compiled", CPU_GRAPHS)
    assert not asks_for_context(engine, asked, context_drafts=True)  # the context shape is not compiled yet
    fake_context_round(engine.model)
    assert asks_for_context(engine, asked, context_drafts=True)
    assert not asks_for_context(engine, asked, context_drafts=False)


def test_where_the_general_loop_runs_either_way_they_are_asked_for_if_the_chain_still_fits_a_graph(
    recorded, monkeypatch,
):  # fmt: skip
    engine, asked = recorded
    model = engine.model
    assert model.tree.total_token + model.context_chain > 16  # the tiny tree with a chain: past 16 rows
    monkeypatch.setattr(model.base, "compiled", SimpleNamespace(kind="inductor", buckets=(1, 8, 16)))
    assert not asks_for_context(engine, asked, context_drafts=True, temperature=0.7)  # would verify eagerly
    monkeypatch.setattr(model.base, "compiled", CPU_GRAPHS)
    assert asks_for_context(engine, asked, context_drafts=True, temperature=0.7)  # sampling: the loop either way
    monkeypatch.setattr(model.base, "compiled", SimpleNamespace(kind="CUDA graphs", buckets=(1, 16, 64)))
    assert asks_for_context(engine, asked, context_drafts=True)


# the idle sequence -------------------------------------------------------------------------------------------
@pytest.fixture
def compiled_forwards(tmp_path, monkeypatch):
    """An engine on (pretended) compiled forwards, whose round graphs load without compiling anything."""
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(CompiledRound, "warm", lambda self, log=None, context=64, steps=None: dict.fromkeys(steps, 0.0))
    engine = tiny_engine(str(tmp_path))
    monkeypatch.setattr(engine.model.base, "compiled", CPU_GRAPHS)
    engine.compiled_in_use()  # as `compiled_rounds` says before the round's steps
    spec = CompileSpec(base_path="base", head_path="draft", dtype="float32", draft_dtype="float32", few_row_plan=None,
                       base_buckets=(16,), draft_buckets=(4,), threads=1)  # fmt: skip
    return engine, spec


class FailedChild:
    """A ChildCompile that failed before compiling anything."""

    compiled, error, finished, paused = [], "RuntimeError: no compiler", True, False

    def __init__(self, spec):
        self.spec = spec

    def pause(self):
        pass

    def resume(self):
        pass

    def progress(self):
        return "compiling"


def test_the_context_shape_comes_in_after_the_two_step_rounds_and_only_then_gets_context_drafts(
    compiled_forwards, monkeypatch,
):  # fmt: skip
    engine, spec = compiled_forwards
    monkeypatch.setattr(precompile, "compiled_before", lambda spec: True)  # in inductor's cache: no child
    lines = []  # (line, whether a reply would get context drafts when it was logged)
    log = lambda line: lines.append((line, engine.context_drafts_served()))  # noqa: E731
    engine.add_job(compiled_round_steps(engine, spec, log))
    engine.run_idle_work(timeout=60)
    in_use = [line for line, _ in lines if line.endswith("in use (draft, verify)") or "context drafts in" in line]
    assert in_use == ["rounds in two compiled steps in use (draft, verify)",
                      "rounds with context drafts in compiled steps in use (draft, verify, verify with a chain)"]
    served = dict(lines)
    assert served[in_use[0]] is False and served[in_use[1]] is True  # never before the context round is in
    assert "loaded the round's verify step with a context chain in 0.0 s" in served
    chains = sorted(shape.chain for shape in engine.model.compiled_rounds)
    assert chains == [0, engine.model.context_chain]
    assert "where they measure worth it (compiled rounds)" in engine.info["context_drafts"]


def test_a_failed_context_compile_leaves_compiled_replies_without_context_drafts(compiled_forwards, monkeypatch):
    engine, spec = compiled_forwards
    monkeypatch.setattr(precompile, "compiled_before", lambda spec: not spec.round_chains)  # the chain: compiled now
    monkeypatch.setattr(precompile, "ChildCompile", FailedChild)
    lines = []
    engine.add_job(compiled_round_steps(engine, spec, lines.append))
    engine.run_idle_work(timeout=60)
    assert lines[-1] == ("compiling the round with context drafts stopped (RuntimeError: no compiler); replies on "
                         "compiled rounds go without them")  # fmt: skip
    assert not engine.context_drafts_served() and [s.chain for s in engine.model.compiled_rounds] == [0]
    assert "off for greedy replies until their compiled round is in" in engine.info["context_drafts"]


def test_a_spec_without_a_chain_keeps_its_json_and_one_with_a_chain_has_a_third_round_step():
    plain = CompileSpec(base_path="b", head_path="h", dtype="float32", draft_dtype="float32", few_row_plan=None,
                        base_buckets=(), draft_buckets=(), threads=1, round_tree=(8, 3, 2))  # fmt: skip
    assert "round_chains" not in plain.to_json()  # the key (and the manifest of earlier starts) stays as it was
    chained = CompileSpec.from_json(plain.to_json().replace("{", '{"round_chains": [4, 16], ', 1))
    assert chained.round_chains == (4, 16)
    assert CompileSpec.from_json(plain.to_json()) == plain and CompileSpec.from_json(chained.to_json()) == chained
    nodes = plain.graphs()[0][1]
    assert plain.graphs() == [("round_verify", nodes), ("round_draft", nodes)]
    assert chained.graphs() == [("round_verify", nodes), ("round_verify_chain", nodes), ("round_draft", nodes)]
    names = {graph_name(k, n, (4, 16)) for k, n in chained.graphs()}
    assert len(names) == 3 and not names & {graph_name(k, n) for k, n in plain.graphs()}
