"""Counts and articles in what the commands print: "1 row", "2 rows", "an ernie4_5 model"."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n noun`, the noun in the plural unless `n` is 1 (`plural` where adding an s does not make it)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def a(word: str) -> str:
    """`word` after its article: "a llama", "an ernie4_5" (by its first letter)."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"
