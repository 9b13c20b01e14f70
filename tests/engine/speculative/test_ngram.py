"""Prompt lookup: what follows the latest earlier occurrence of the last n-gram."""

from kvgen.engine.speculative import PromptLookup


def test_proposes_what_followed_the_latest_match():
    look = PromptLookup(max_ngram=3, min_ngram=2)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert look.lookup(tokens, 2) == [7, 8]  # the later of the two [1, 2, 3] wins
    assert look.lookup(tokens, 10) == [7, 8, 5, 1, 2, 3]  # up to the end, never past it


def test_longer_ngrams_first_and_none_without_a_match():
    look = PromptLookup(max_ngram=3, min_ngram=2)
    assert look.lookup([4, 2, 3, 6, 1, 2, 3], 1) == [6]  # only the 2-gram [2, 3] recurs
    assert look.lookup([5, 3, 6, 1, 2, 3], 1) == []  # a 1-gram is below min_ngram
    assert look.lookup([1, 2], 3) == [] and look.lookup([1, 2, 1, 2], 0) == []
