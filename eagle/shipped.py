"""Where the files this project ships beside its code are: the draft head, the page's CSS and logo.

In a clone they are the repository's `assets/` folder; an installed package carries the same files as
`eagle/assets/` (pyproject.toml maps the folder there). The first of the two that exists is used.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
ASSETS = next((p for p in (_HERE.parent / "assets", _HERE / "assets") if p.is_dir()), _HERE.parent / "assets")
