"""Aligned plain-text tables for the benchmark scripts (no dependencies)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["print_table", "format_table", "fmt_rate"]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _is_numeric(text: str) -> bool:
    stripped = text.replace(",", "").replace(".", "").replace("x", "").replace("%", "").lstrip("+-")
    return stripped.isdigit()


def format_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Render ``rows`` under ``headers``; numbers are right-aligned, text left-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells, the table has {len(headers)} columns")
    widths = [max([len(h)] + [len(r[c]) for r in cells]) for c, h in enumerate(headers)]
    numeric = [bool(cells) and all(_is_numeric(r[c]) or r[c] == "-" for r in cells) for c in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [title, line(list(headers)), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print an aligned table followed by a blank line."""
    print(format_table(title, headers, rows))
    print(flush=True)


def fmt_rate(per_second: float) -> str:
    """A rate with an SI suffix: 1.23M, 456k, 789."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_second >= div:
            return f"{per_second / div:.3g}{suffix}"
    return f"{per_second:.3g}"
