"""The round profiler on a tiny model: every phase is timed, the rows add up, the engine is left unpatched."""

import json

import pytest
import torch
from tiny import random_draft, save_base, tiny_base

from eagle.decoding import generate
from eagle.decoding.draft import Drafter
from eagle.evaluation import pass_cost, profile
from eagle.models.base import BaseModel
from eagle.runtime.round_graphs import EagerRound


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add contention
    folder = tmp_path_factory.mktemp("profile")
    base = tiny_base("llama", seed=8)
    save_base(base, str(folder / "base"))
    random_draft(base, str(folder / "head"), eagle3=True)
    q = {"question_id": 1, "category": "writing", "turns": ["w7 w8 w9 w10 w7 w8"]}
    (folder / "q.jsonl").write_text(json.dumps(q) + "\n")
    yield folder
    torch.set_num_threads(n)


def profile_argv(folder, *extra):
    return ["--base-model-path", str(folder / "base"), "--ea-model-path", str(folder / "head"), "--question-file",
            str(folder / "q.jsonl"), "--rounds", "12", "--max-new-tokens", "8", "--total-token", "12", "--depth", "3",
            "--top-k", "4", "--json", str(folder / "p.json"), *extra]  # fmt: skip


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_profile_times_every_phase_and_restores_the_engine(folder, capsys, static):
    originals = (BaseModel.forward, Drafter.commit, generate.accept, generate.tree_mask, EagerRound.verify)
    result = profile.main(profile_argv(folder, "--static" if static else "--general"))
    assert (BaseModel.forward, Drafter.commit, generate.accept, generate.tree_mask, EagerRound.verify) == originals
    assert result["rounds"] == 12 and result["prompts"] >= 2  # 8 tokens per prompt: the prompt is reused
    phases = result["phases"]
    for key, _ in profile.PHASES:
        if key not in ("draft_step", "verify_step") and (key != "draft_forward" or not static):
            assert phases[key]["ms_per_round"] > 0, key
    assert phases["verify"]["calls_per_round"] == 1.0 and phases["compact"]["calls_per_round"] == 1.0
    assert sum(p["ms_per_round"] for p in phases.values()) == pytest.approx(result["round_ms"])
    assert phases["python"]["ms_per_round"] >= 0
    assert result["vanilla_step_ms"] > 0 and result["tokens_per_round"] >= 1.0
    out = capsys.readouterr().out
    assert "| base verify forward: decoder over the tree |" in out and "KV compaction" in out
    assert json.loads((folder / "p.json").read_text())["rounds"] == 12


def test_profile_times_the_two_step_round_as_two_phases(folder, capsys):
    """Greedy rounds of a dynamic tree run in two steps (round_steps.py): a draft step and a verify step a round."""
    result = profile.main(profile_argv(folder))
    phases = result["phases"]
    for key in ("draft_step", "verify_step"):
        assert phases[key]["calls_per_round"] == 1.0 and phases[key]["ms_per_round"] > 0, key
    # the forwards' phase is inside the verify step; the path's KV rows are kept after the round's host read
    assert phases["verify"]["calls_per_round"] == 0 and phases["compact"]["calls_per_round"] == 1.0
    assert sum(p["ms_per_round"] for p in phases.values()) == pytest.approx(result["round_ms"])
    out = capsys.readouterr().out
    assert "the round's verify step" in out and "KV compaction (base cache)" in out


def test_pass_cost_times_each_row_count_with_the_plan_and_with_each_few_row_kernel(folder, capsys):
    argv = ["--base-model-path", str(folder / "base"), "--ea-model-path", str(folder / "head"), "--rows", "4,1,2",
            "--context", "8", "--repeats", "2", "--json", str(folder / "c.json")]  # fmt: skip
    result = pass_cost.main(argv)
    assert result["rows"] == [1, 2, 4]
    assert set(result["kernel_ms"]) >= {"linear", "wxt"}  # float32 on CPU: every kernel timed
    for timings in (result["engine_ms"], *result["kernel_ms"].values()):
        assert set(timings) == {1, 2, 4} and all(ms > 0 for ms in timings.values())
    assert result["plan"] is None or set(result["plan"].values()) <= set(result["kernel_ms"])
    assert json.loads((folder / "c.json").read_text())["rows"] == [1, 2, 4]
    assert "| 4 |" in capsys.readouterr().out
    assert result["floor"]["ms_per_token"] > 0 and result["cpu"]["cpus"] >= 1


def test_pass_cost_times_the_few_row_kernels_eagerly_beside_compiled_rounds(folder):
    """With compiled rounds in use, the engine column is theirs where a bucket holds the rows and the kernels'
    columns are eager forwards (graphs: the CUDA-graph runner without capture, which compiles nothing)."""
    from eagle.model.ea_model import EaModel
    from eagle.runtime.cuda_graphs import GraphedDecode

    model = EaModel.from_pretrained(str(folder / "base"), str(folder / "head"), dtype=torch.float32)
    graphs = model.base.compiled = GraphedDecode(model.base, (1, 2), capacity=64, capture=False)
    calls = []
    run = graphs.steps.run
    graphs.steps.run = lambda key, *args: calls.append(key[0]) or run(key, *args)
    result = pass_cost.measure(model, [1, 2, 4], context=8, repeats=2)
    assert result["compiled_rows"] == [1, 2] and model.base.compiled is graphs
    assert sorted(set(calls)) == [1, 2] and len(calls) == 2 * 3  # the engine's 1- and 2-row passes only
    assert "| 4 | " in pass_cost.table(result) and "| 2 | " in pass_cost.table(result)
    assert "compiled" in pass_cost.table(result).splitlines()[3] and set(result["kernel_ms"]) >= {"linear", "wxt"}



@pytest.mark.parametrize("tool,argv,message", [
    (pass_cost, ["--rows", "0,2"], "--rows, --context and --repeats must be >= 1"),
    (profile, ["--rounds", "0"], "--rounds and --max-new-tokens must be > 0"),
])  # fmt: skip
def test_bad_options_end_the_tool_with_one_line_and_status_2(tool, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {message}")


def test_the_tools_take_the_model_type_aliases_launch_py_takes(capsys):
    from eagle.evaluation.models import pick_type

    args = pass_cost.build_parser().parse_args(["--model-type", "llama-3-instruct"])
    assert pick_type(args).name == "llama3"
    with pytest.raises(SystemExit) as e:
        pass_cost.main(["--model-type", "llama9"])
    assert e.value.code == 2 and "unknown model type 'llama9'" in capsys.readouterr().err


def test_round_ab_runs_every_path_on_every_prompt_and_finds_them_identical(folder, capsys):
    """The two-step round, the general loop and vanilla decoding, interleaved per prompt: greedy, all identical."""
    from eagle.evaluation import round_ab

    argv = ["--base-model-path", str(folder / "base"), "--ea-model-path", str(folder / "head"), "--question-file",
            str(folder / "q.jsonl"), "--max-new-tokens", "12", "--total-token", "8", "--depth", "3", "--top-k", "2",
            "--compile", "off", "--json", str(folder / "ab.json")]  # fmt: skip
    assert round_ab.main(argv) == 0
    rows = {r["path"]: r for r in json.loads((folder / "ab.json").read_text())["rows"]}
    assert set(rows) == {"vanilla", "general", "two_step"}
    assert all(r["identical"] == "1/1" for r in rows.values())
    assert rows["vanilla"]["tau"] == 1.0 and rows["two_step"]["tau"] == rows["general"]["tau"]
    assert rows["vanilla"]["round_in_vanilla_steps"] == pytest.approx(1.0)
    assert "| two_step |" in capsys.readouterr().out
    argv[argv.index("--question-file"):argv.index("--question-file") + 2] = ["--bench", "repetitive", "--limit", "1"]
    assert round_ab.main(argv) == 0  # the bench's question sets too
