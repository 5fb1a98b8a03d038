"""ContextIndex (context drafts' look-up): the longest earlier-occurring suffix, its most recent occurrence and the
tokens that followed it, checked by hand and against a brute-force reference over random sequences."""

import random
import time

import pytest

from eagle.decoding.context_index import ContextIndex


def reference(seq: list[int], limit: int, max_match: int) -> tuple[list[int], int]:
    """By brute force: the longest suffix of seq that also ends before its last position, capped at max_match;
    the most recent such earlier end p; seq[p + 1 : p + 1 + limit]."""
    n = len(seq)

    def ends(m: int) -> list[int]:  # earlier end positions of the suffix of length m
        return [j for j in range(m - 1, n - 1) if seq[j - m + 1 : j + 1] == seq[n - m :]]

    longest = 0
    while longest + 1 < n and ends(longest + 1):  # a suffix that occurred before has all its suffixes occur before
        longest += 1
    m = min(longest, max_match)
    if m == 0:
        return [], 0
    p = max(ends(m))
    return (seq[p + 1 : p + 1 + limit] if limit > 0 else []), m


def test_longest_match_found_across_prompt_and_reply():
    prompt = [7, 1, 2, 3, 4, 8]
    reply = [9, 2, 3, 5, 6, 1, 2, 3]  # "2 3" also occurs in the reply, later; "1 2 3" only in the prompt
    index = ContextIndex(prompt)
    index.extend(reply)
    assert index.propose(4) == ([4, 8, 9, 2], 3)


def test_match_is_capped_at_max_match_and_then_the_most_recent_occurrence_of_the_capped_suffix_wins():
    seq = [1, 2, 3, 4, 10, 9, 3, 4, 11, 1, 2, 3, 4]  # "1 2 3 4" ends at 3; "3 4" last ended at 7
    assert ContextIndex(seq, max_match=8).propose(2) == ([10, 9], 4)
    assert ContextIndex(seq, max_match=2).propose(2) == ([11, 1], 2)


def test_most_recent_occurrence_preferred():
    index = ContextIndex([5, 1, 2, 30, 6, 1, 2, 40, 7, 1, 2, 50, 1, 2])
    assert index.propose(3) == ([50, 1, 2], 2)


def test_most_recent_occurrence_preferred_when_it_was_seen_only_inside_a_longer_match():
    # "3" last ended at 6 as the end of "2 3" (a longer match then); an end position kept only for the state
    # matched at the time would still say 3
    seq = [3, 9, 2, 3, 8, 2, 3, 7, 3]
    assert ContextIndex(seq).propose(5) == ([7, 3], 1)
    assert reference(seq, 5, 32) == ([7, 3], 1)


def test_continuation_cut_at_limit_and_at_sequence_end():
    index = ContextIndex([1, 2, 3, 4, 5, 6, 1, 2])
    assert index.propose(3) == ([3, 4, 5], 2)
    assert index.propose(100) == ([3, 4, 5, 6, 1, 2], 2)
    assert index.propose(0) == ([], 2) and index.propose(-3) == ([], 2)
    index.extend([3, 4, 5, 6, 1])  # the match runs up to the end: the continuation is what is left after it
    assert index.propose(100) == ([2, 3, 4, 5, 6, 1], 7)


def test_no_match_gives_empty():
    assert ContextIndex().propose(4) == ([], 0)
    assert len(ContextIndex()) == 0
    single = ContextIndex([7])
    assert single.propose(4) == ([], 0) and len(single) == 1
    index = ContextIndex([1, 2, 3, 1, 2])
    index.extend([4])  # 4 never occurred before
    assert index.propose(4) == ([], 0)
    with pytest.raises(ValueError):
        ContextIndex(max_match=0)


def test_periodic_text_continuation_overlaps_the_suffix():
    index = ContextIndex([1, 2, 1, 2, 1, 2])
    assert index.propose(8) == ([1, 2], 4)  # "1 2 1 2" last ended at 3; what follows runs into the suffix itself
    run = ContextIndex([4] * 10, max_match=3)
    assert run.propose(5) == ([4], 3)
    assert ContextIndex([4] * 10, max_match=20).propose(5) == ([4], 9)


@pytest.mark.parametrize("seed", range(6))
def test_extend_in_chunks_equals_one_by_one_and_the_reference(seed):
    rng = random.Random(seed)
    for _ in range(12):
        alphabet = rng.choice([1, 2, 3, 4])
        max_match = rng.choice([1, 2, 3, 5, 1000])
        seq = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 90))]
        if rng.random() < 0.5:  # copied spans, as in edited code or quoted text
            start = rng.randrange(len(seq))
            seq += seq[start : start + rng.randrange(1, 30)] + [rng.randrange(alphabet) for _ in range(20)]
        one = ContextIndex(max_match=max_match)
        for n, token in enumerate(seq, 1):
            one.extend([token])
            limit = rng.randrange(0, 12)
            assert one.propose(limit) == reference(seq[:n], limit, max_match), (seq[:n], limit, max_match)
        chunked = ContextIndex(seq[: rng.randrange(len(seq) + 1)], max_match=max_match)
        while len(chunked) < len(seq):
            n = min(len(seq), len(chunked) + rng.randrange(1, 9))
            chunked.extend(seq[len(chunked) : n])
            assert chunked.propose(20) == reference(seq[:n], 20, max_match)
        assert len(chunked) == len(one) == len(seq)
        assert chunked.propose(50) == one.propose(50)


def test_incremental_cost_on_100k_tokens():
    rng = random.Random(0)
    seq: list[int] = []
    while len(seq) < 100_000:  # fresh text, copies of earlier spans, and runs of one token (the deepest case)
        kind = rng.random()
        if kind < 0.5 or len(seq) < 100:
            seq += [rng.randrange(2000) for _ in range(rng.randrange(1, 50))]
        elif kind < 0.9:
            start = rng.randrange(len(seq) - 50)
            seq += seq[start : start + rng.randrange(5, 200)]
        else:
            seq += [13] * rng.randrange(10, 300)
    seq = seq[:100_000]
    index = ContextIndex()
    t0 = time.perf_counter()
    proposed = 0
    for start in range(0, len(seq), 7):
        index.extend(seq[start : start + 7])
        proposed += len(index.propose(8)[0])
    elapsed = time.perf_counter() - t0
    assert len(index) == 100_000
    assert proposed > 0
    assert elapsed < 5.0, elapsed  # a sanity bound: the index is linear; a rescan per token would take minutes
    assert index.propose(8) == capped_reference(seq, 8, 32)


def capped_reference(seq: list[int], limit: int, max_match: int) -> tuple[list[int], int]:
    """`reference` for a long sequence: only suffixes up to max_match tokens are tried, longest first."""
    n = len(seq)
    m = min(max_match, n - 1)
    while m > 0:
        suffix = seq[n - m :]
        ends = [j for j in range(n - 2, m - 2, -1) if seq[j - m + 1 : j + 1] == suffix]
        if ends:
            return seq[ends[0] + 1 : ends[0] + 1 + limit], m
        m -= 1
    return [], 0
