"""The algorithm, on token ids and tensors: the decoding loops as streams of rounds (`generate.py`: prefill, then
draft -> verify -> accept), drafting a tree with the head (`draft.py`) or from the context (`context_draft.py`,
`context_index.py`), trees (`tree.py`), acceptance for every EAGLE version and vanilla (`verify.py`), and the greedy
round as two functions of tensors that the runtime compiles (`round_steps.py`), and a conversation's caches kept
between turns (`prefix_cache.py`). No compile flag lives here."""
