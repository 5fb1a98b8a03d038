"""Training EAGLE draft heads: `python -m eagle.train prepare ...` then `python -m eagle.train fit ...`.

masks.py (chat template -> loss mask), data.py (prepare + cached dataset), vocab.py (EAGLE-3 d2t/t2d),
ttt.py (the head unrolled over whole sequences), losses.py (both recipes' objectives), fit.py (training loop,
checkpoints, held-out evaluation), export.py (official checkpoint layout). See docs/training.md.
"""
