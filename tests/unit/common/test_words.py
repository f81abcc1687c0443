from common.words import a


def test_kinds_take_the_article_they_are_said_with() -> None:
    assert [a(kind) for kind in ("llm", "embedding", "reranker", "python")] == [
        "an llm",
        "an embedding",
        "a reranker",
        "a python",
    ]
