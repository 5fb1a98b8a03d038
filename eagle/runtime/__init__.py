"""How a round's steps run: eagerly, as inductor graphs on a CPU (`compiled.py`, `compiled_draft.py`,
`round_graphs.py`, saved whole by `aot_store.py`) or as CUDA graphs (`cuda_graphs.py`, `cuda_round.py`). `runners.py`
is the one place that builds them, from a model's `RuntimeConfig` (`config.py`); the algorithm (`eagle.decoding`)
never imports this package."""
