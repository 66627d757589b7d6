"""Tests of tinygpt.corpus: the grammar corpus and its exact next-word distributions."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from tinygpt import corpus
from tinygpt.corpus import (
    END,
    generate_corpus,
    join_words,
    next_word_distribution,
    prefix_probability,
    sample_prefixes,
    sample_sentence,
    sample_story,
    split_words,
    story_probability,
)

# --------------------------------------------------------------------------------------------
# Hand-computed distributions (from the tables written out in corpus.py, multiplied by hand).
# --------------------------------------------------------------------------------------------


def test_story_start_is_the_subject_determiner():
    assert next_word_distribution("") == {"The": 0.6, "A": 0.4}


def test_cat_sat_on_the_is_non_trivial_and_exact():
    dist = next_word_distribution("The cat sat on the")
    assert dist == pytest.approx({"mat": 0.4, "bed": 0.25, "chair": 0.2, "box": 0.15}, abs=1e-15)
    assert list(dist) == ["mat", "bed", "chair", "box"]  # sorted by decreasing probability


def test_after_the_noun_or_adjective():
    # P(no adjective) = 0.75 times the noun table, P(adjective) = 0.25 times the adjective table
    dist = next_word_distribution("The")
    expected = {"cat": 0.75 * 0.25, "dog": 0.75 * 0.25, "bird": 0.75 * 0.15, "fish": 0.75 * 0.1,
                "boy": 0.75 * 0.125, "girl": 0.75 * 0.125, "big": 0.25 * 0.35,
                "small": 0.25 * 0.35, "little": 0.25 * 0.15, "young": 0.25 * 0.15}
    assert dist == pytest.approx(expected, abs=1e-15)


def test_context_changes_the_places():
    bird = next_word_distribution("The bird sat on the")
    assert bird == pytest.approx({"tree": 0.5, "roof": 0.3, "fence": 0.2})
    flew = next_word_distribution("A small bird flew over the")
    assert flew == pytest.approx({"tree": 0.3, "house": 0.3, "park": 0.2, "river": 0.2})
    # the pronoun refers to the previous *subject* (the bird), not to the object (the cat)
    it = next_word_distribution("The bird saw a cat. It sat on the")
    assert it == pytest.approx(bird)


def test_verb_after_subject_mixes_the_three_shapes():
    # first sentence: move 0.5, see 0.3, feel 0.2; a fish only swims and sees
    dist = next_word_distribution("The fish")
    assert dist == pytest.approx({"swam": 0.5, "saw": 0.3, "was": 0.2})
    dist = next_word_distribution("The cat")
    assert dist == pytest.approx({"sat": 0.5 * 0.35, "slept": 0.5 * 0.25, "ran": 0.5 * 0.2,
                                  "jumped": 0.5 * 0.2, "saw": 0.3 * 0.5, "chased": 0.3 * 0.5,
                                  "was": 0.2})


def test_sentence_boundary():
    # after "." : stop (0.5) or continue (0.5) with pronoun 0.6 / same noun 0.15 / new NP 0.25
    dist = next_word_distribution("The boy sat on the mat.")
    expected = {END: 0.5, "He": 0.5 * 0.6, "The": 0.5 * (0.15 + 0.25 * 0.6),
                "A": 0.5 * 0.25 * 0.4}
    assert dist == pytest.approx(expected, abs=1e-15)
    # "The boy" after a sentence about a boy is reachable two ways (same noun and new NP);
    # the next word after "The" must weight "boy" by both derivations.
    dist = next_word_distribution("The boy sat on the mat. The")
    same, new_the = 0.15, 0.25 * 0.6
    boy = (same + new_the * 0.75 * 0.125) / (same + new_the)
    assert dist["boy"] == pytest.approx(boy, abs=1e-15)
    # after MAX_SENTENCES sentences the story must end
    three = "The cat was sad. It was sad. It was sad."
    assert next_word_distribution(three) == {END: 1.0}


def test_probabilities_sum_to_one_everywhere():
    for prefix in sample_prefixes(200, seed=5):
        dist = next_word_distribution(prefix)
        assert math.isclose(sum(dist.values()), 1.0, abs_tol=1e-12), prefix
        assert all(p > 0 for p in dist.values())


def test_every_table_sums_to_one():
    for table in corpus._all_tables():
        assert math.isclose(sum(table.values()), 1.0, abs_tol=1e-12), table


# --------------------------------------------------------------------------------------------
# Sampling agrees with the exact distributions.
# --------------------------------------------------------------------------------------------


def _chi_square_check(counts: Counter, dist: dict[str, float], n: int) -> None:
    """Every observed word is allowed, each count within 5 sigma, chi^2 below mean + 6 sd."""
    assert set(counts) <= set(dist), set(counts) - set(dist)
    chi2 = 0.0
    for word, p in dist.items():
        expected = n * p
        sigma = math.sqrt(n * p * (1 - p)) if p < 1 else 1.0
        assert abs(counts[word] - expected) < 5 * sigma + 1, (word, counts[word], expected)
        chi2 += (counts[word] - expected) ** 2 / expected
    dof = max(len(dist) - 1, 1)
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, dof)


@pytest.fixture(scope="module")
def sample_words() -> list[list[str]]:
    text = generate_corpus(20000, seed=123)
    return [split_words(line) + [END] for line in text.split("\n")]


@pytest.mark.parametrize("prefix", ["", "The", "The cat", "The cat sat on the", "A dog",
                                    "The cat sat on the mat.", "The bird", "The dog chased"])
def test_empirical_next_word_frequencies(sample_words, prefix):
    target = split_words(prefix)
    k = len(target)
    counts = Counter(words[k] for words in sample_words if words[:k] == target)
    n = sum(counts.values())
    assert n >= 100, f"too few samples start with {prefix!r}"
    _chi_square_check(counts, next_word_distribution(prefix), n)


def test_empirical_story_probability(sample_words):
    most_likely = "The cat sat on the mat."
    n = sum(1 for words in sample_words if join_words(words[:-1]) == most_likely)
    p = story_probability(most_likely)
    assert p == pytest.approx(0.6 * 0.75 * 0.25 * 0.5 * 0.35 * 0.7 * 0.4 * 0.5)
    assert abs(n - 20000 * p) < 5 * math.sqrt(20000 * p * (1 - p))


def test_sample_sentence_matches_first_sentence_distribution():
    rng = random.Random(7)
    n = 4000
    counts = Counter(split_words(sample_sentence(rng))[1] for _ in range(n))
    # second word of a first sentence, marginalised over the first word The/A
    dist = next_word_distribution("The")
    assert next_word_distribution("A") == pytest.approx(dist)
    _chi_square_check(counts, dist, n)


def test_every_sample_parses_word_by_word():
    rng = random.Random(11)
    for _ in range(60):
        words = split_words(sample_story(rng)) + [END]
        chain = 1.0
        for k in range(len(words)):
            dist = next_word_distribution(join_words(words[:k]))
            assert words[k] in dist, (words, k, dist)
            chain *= dist[words[k]]
        story = join_words(words[:-1])
        assert story_probability(story) == pytest.approx(chain, rel=1e-12)
        assert prefix_probability(story) >= story_probability(story) > 0
    for _ in range(60):
        sentence = sample_sentence(rng)
        assert sentence.endswith(".") and sentence.count(".") == 1
        assert prefix_probability(sentence) > 0


# --------------------------------------------------------------------------------------------
# Determinism, text conventions and errors.
# --------------------------------------------------------------------------------------------


def test_generate_corpus_is_deterministic_by_seed():
    a = generate_corpus(300, seed=1)
    assert a == generate_corpus(300, seed=1)
    assert a != generate_corpus(300, seed=2)
    assert generate_corpus(500, seed=1).startswith(a + "\n")
    lines = a.split("\n")
    assert len(lines) == 300
    assert all(line and line.endswith(".") and line[0].isupper() for line in lines)
    assert sample_prefixes(20, seed=3) == sample_prefixes(20, seed=3)


def test_split_and_join_words():
    assert split_words("The cat sat. It  was\nhappy.") == [
        "The", "cat", "sat", ".", "It", "was", "happy", "."]
    assert join_words(["The", "cat", "sat", ".", "It", "was", "happy", "."]) == \
        "The cat sat. It was happy."
    assert join_words([]) == "" and split_words("") == []
    with pytest.raises(ValueError, match="END"):
        join_words(["The", END])
    with pytest.raises(ValueError, match="','"):
        split_words("The cat, the dog")


@pytest.mark.parametrize("prefix, message", [
    ("The cat flew", "after 'The cat' the word 'flew' cannot follow"),
    ("The mouse", "'mouse' cannot follow"),  # mouse is only ever an object
    ("the cat", "after '' the word 'the' cannot follow"),  # case-sensitive
    ("The fish sat", "'sat' cannot follow"),
    ("The bird flew over the tree. It swam", "'swam' cannot follow"),  # It = the bird
    ("The cat sat on the mat", None),  # possible: must not raise
    ("The cat sat on the mat. The cat was sad. It was sad. It", "'It' cannot follow"),
    ("The dog barked", "'barked' is not in the grammar's vocabulary"),
    ("The cat sat on the mat..", "'.' cannot follow"),
])
def test_impossible_prefixes_raise(prefix, message):
    if message is None:
        next_word_distribution(prefix)
        return
    with pytest.raises(ValueError, match="impossible prefix") as info:
        next_word_distribution(prefix)
    assert message in str(info.value)
    assert prefix_probability(prefix) == 0.0


def test_bad_arguments():
    with pytest.raises(TypeError, match="text must be a str"):
        next_word_distribution(["The"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only ASCII letters"):
        next_word_distribution("The cat <|endoftext|>")
    with pytest.raises(ValueError, match="n_stories must be >= 1"):
        generate_corpus(0, seed=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        generate_corpus(3, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rng must be a random.Random"):
        sample_sentence(0)  # type: ignore[arg-type]
    assert story_probability("The cat sat on the") == 0.0  # not a complete story


def test_word_classes_follow_the_grammar_slots():
    from tinygpt.corpus import VOCABULARY, WORD_CLASS

    assert set(WORD_CLASS) == VOCABULARY
    assert WORD_CLASS["The"] == WORD_CLASS["a"] == "determiner"
    assert WORD_CLASS["cat"] == WORD_CLASS["mouse"] == WORD_CLASS["ball"] == "noun"
    assert WORD_CLASS["mat"] == WORD_CLASS["tree"] == "place"
    assert WORD_CLASS["sat"] == WORD_CLASS["chased"] == WORD_CLASS["was"] == "verb"
    assert (WORD_CLASS["It"], WORD_CLASS["on"], WORD_CLASS["happy"], WORD_CLASS["."]) == (
        "pronoun", "preposition", "feeling", "period")
    # every word of a sampled story has its class in the slot the grammar gave it
    rng = random.Random(3)
    for _ in range(50):
        words = split_words(sample_story(rng))
        for before, word in zip(words, words[1:], strict=False):
            if WORD_CLASS[before] == "preposition":
                assert word == "the" and WORD_CLASS[word] == "determiner"
            if WORD_CLASS[before] == "pronoun":
                assert WORD_CLASS[word] in ("verb",)
