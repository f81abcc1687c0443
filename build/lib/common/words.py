"""Words in messages people read."""

from __future__ import annotations

# Words Gantry's messages use that are said letter by letter from a vowel sound ("an LLM").
_SPELLED = ("llm",)


def a(noun: str) -> str:
    """``noun`` with its indefinite article: "an llm", "an embedding", "a reranker"."""
    vowel = noun[:1].lower() in "aeiou" or noun.lower().startswith(_SPELLED)
    return f"an {noun}" if vowel else f"a {noun}"
