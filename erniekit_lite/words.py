"""Counts in what the commands print: "1 row", "2 rows"."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n noun`, the noun in the plural unless `n` is 1 (`plural` where adding an s does not make it)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
