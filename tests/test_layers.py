"""The import layers hold: `lint-imports` (import-linter) passes on pyproject.toml's contracts, the contracts that
keep the engine apart from the app are among them, and the same run reports a contract that the code breaks."""

import os
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    script = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    cmd = [script] if os.path.exists(script) else [
        sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([*cmd, "--no-cache", "--no-logo", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_the_import_contracts_are_kept():
    run = lint_imports()
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert " 0 broken" in out and " KEPT" in out, out


def test_the_engine_and_model_contracts_are_configured():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)["tool"]["importlinter"]
    assert set(config["root_packages"]) == {"eagle", "app"}
    forbidden = {(tuple(c["source_modules"]), tuple(c["forbidden_modules"])) for c in config["contracts"]
                 if c["type"] == "forbidden"}  # fmt: skip
    assert (("eagle",), ("app",)) in forbidden
    engine = ("eagle.model", "eagle.tuning", "eagle.runtime", "eagle.decoding", "eagle.models", "eagle.kernels")
    assert (engine, ("eagle.chat", "eagle.evaluation", "eagle.train")) in forbidden


def test_a_broken_contract_is_reported(tmp_path):
    """The app imports the engine: a contract that forbids it must come back broken, naming an import."""
    config = tmp_path / "broken.toml"
    config.write_text('[tool.importlinter]\nroot_packages = ["eagle", "app"]\n\n'
                      '[[tool.importlinter.contracts]]\nname = "app without eagle"\ntype = "forbidden"\n'
                      'source_modules = ["app"]\nforbidden_modules = ["eagle"]\n')  # fmt: skip
    run = lint_imports(str(config))
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "app without eagle BROKEN" in out and "0 kept, 1 broken" in out, out
    assert re.search(r"^-\s+app\.\w+ -> eagle\.", out, re.M), out  # a line of the import that breaks it
