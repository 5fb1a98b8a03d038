"""The EAGLE-2 tree and the kernels chosen by measuring them on the machine at hand (`tuner.py`), with the
measurements cached per machine, base and build (`cost_cache.py`). Tuning returns choices; the caller applies them."""
