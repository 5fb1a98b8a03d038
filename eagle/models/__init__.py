"""The networks and their state: the base run through transformers' classes with tree masks (`base.py`), the EAGLE
draft head (`draft_head.py`) and its checkpoints in every producer's layout (`checkpoint.py`, `head_formats.py`),
the KV cache (`kv_cache.py`), attention masks (`masks.py`) and a base's logit processing (`logits.py`)."""
