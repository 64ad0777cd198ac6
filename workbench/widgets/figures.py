"""Matplotlib figures shown in `ipywidgets.Output` widgets without pyplot.

Cells draw on plain `matplotlib.figure.Figure` objects (no global pyplot state,
safe on worker threads) and hand them to an Output widget as PNG display data.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from matplotlib.figure import Figure


def png_output(fig: Figure, dpi: int = 90) -> dict[str, Any]:
    """An Output-widget display_data entry holding `fig` as a PNG; the figure is
    cleared afterwards (Figure objects made without pyplot need no closing)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    fig.clear()
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": data, "text/plain": "<Figure>"}}


def literal(text: str) -> str:
    """`text` as a label matplotlib draws as written: it reads a pair of `$` as math (a
    token "$$" raised a ParseException, "$5 or $6" came out in math italics)."""
    return text.replace("$", r"\$")
