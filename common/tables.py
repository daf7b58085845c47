"""Markdown tables as every run, the report and the benchmarks print them, and FLOP/s
written for reading."""

from __future__ import annotations


def format_flops(flops: float) -> str:
    """e.g. '95.3 GFLOP/s', '989 TFLOP/s'."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops >= scale:
            return f"{flops / scale:,.3g} {unit}"
    return f"{flops / 1e6:,.3g} MFLOP/s"


def markdown_table(header, rows, right=()) -> str:
    """A Markdown table padded for reading in a terminal. Columns whose index is in
    `right` (numbers) are right-aligned, with Markdown's `:` marker; the rest left."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max([3, len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header)]  # `--:` at least

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + ":" if i in right else "-" * w
                             for i, w in enumerate(widths)) + " |"
    return "\n".join([line(header), rule, *map(line, rows)])
