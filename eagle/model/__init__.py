"""The public API, at the reference project's import path: `from eagle.model.ea_model import EaModel`.

`ea_model.py` puts the engine's layers together for a loaded model and `compiling.py` puts its compiled forwards in
use; everything else lives in the layers below (pyproject.toml's import-linter contracts keep their order):
`eagle.tuning` (the tree and kernels measured on the machine at hand), `eagle.runtime` (how a round's steps run:
eagerly, as CPU graphs or as CUDA graphs, behind `runners.py`), `eagle.decoding` (the algorithm: prefill, draft,
verify, accept), `eagle.models` (the base, the draft head, the KV cache, masks, checkpoints) and `eagle.kernels`
(the CPU kernels and attention functions).
"""
