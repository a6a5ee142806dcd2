"""matplotlib for the commands that draw (an optional dependency: ``pip install 'dartspec[bench]'``)."""

from __future__ import annotations

from typing import Any

from dartspec.errors import require


def pyplot(purpose: str = "plotting") -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed), or a clear install hint."""
    require("matplotlib", extra="bench", purpose=purpose)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
