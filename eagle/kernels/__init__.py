"""CPU kernels and attention functions: the panel kernel for few-row linears in float32 and GGUF blocks
(`panel_kernel.py`, `panel_linear.cpp`, `quant_linear.cpp`, `quant_panels.py`, `quant_gguf.py`), their use in a
model's linear layers (`few_rows.py`), batch-invariant row attention (`row_attention.py`, `row_attention.cpp`), SDPA
with shared key/value heads (`shared_kv_sdpa.py`) and KV row compaction (`kv_rows.cpp`)."""
