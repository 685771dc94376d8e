"""The O(n log n) BPE merge for long chunks: same ids as the simple lowest-rank-first loop.

``BPETokenizer`` merges an ordinary chunk (a word) with a simple loop that rescans every pair
after every merge; for a chunk over ``bpe._LONG_CHUNK`` bytes (a base64 blob, a DNA string)
that is quadratic, so it hands the chunk to ``merge_by_heap`` here. ``TiktokenTokenizer``
(Llama 3's files rank merged byte strings, not pairs) uses ``merge_pieces_by_heap`` the same way.
"""

from __future__ import annotations

import heapq
from typing import Callable, Optional, TypeVar

from lucidlm.tokenizers.bpe_trainer import Pair

T = TypeVar("T")


def merge_by_heap(ids: list[int], merge_id: dict[Pair, int]) -> list[int]:
    """BPE-encode ``ids`` with ``merge_id`` (pair -> new id = 256 + rank): the simple loop's result in O(n log n).

    A long chunk (a base64 blob, a DNA string) makes rescanning every pair after every
    merge quadratic. Here a heap holds (merge id, position) for every mergeable pair
    and the tokens form a linked list. Popping in (id, position) order merges the
    earliest-learned pair first and its occurrences left to right - exactly what the
    simple loop does.
    """
    return merge_pieces_by_heap(ids, lambda a, b: merge_id.get((a, b)), lambda a, b, new_id: new_id)


def merge_pieces_by_heap(pieces: list[T], rank: Callable[[T, T], Optional[int]],
                         join: Callable[[T, T, int], T]) -> list[T]:
    """The lowest-rank-first merge loop (leftmost first among equal ranks) over any pieces:
    ``rank(a, b)`` is the rank of merging neighbours a and b (None: never), ``join(a, b, rank)``
    the merged piece. GPT-2's merges: ids and the pair's new id; tiktoken's: bytes and the rank
    of a + b.

    The heap may pop an entry whose neighbours changed since it was pushed (stale: skipped),
    and always holds every current mergeable pair, so each pop is the loop's choice: the
    smallest rank, then the leftmost position (a merged piece keeps its left part's position,
    so positions stay in text order).
    """
    n = len(pieces)
    tokens: list[Optional[T]] = list(pieces)  # None: merged into its left neighbour
    next_pos = list(range(1, n + 1))  # n means "no next token"
    prev_pos = list(range(-1, n - 1))  # -1 means "no previous token"
    heap = [(r, i) for i in range(n - 1) if (r := rank(pieces[i], pieces[i + 1])) is not None]
    heapq.heapify(heap)
    while heap:
        r, i = heapq.heappop(heap)
        j = next_pos[i]
        left_piece = tokens[i]
        if left_piece is None or j == n or rank(left_piece, tokens[j]) != r:
            continue  # stale: a neighbour changed since this entry was pushed
        merged = join(left_piece, tokens[j], r)
        tokens[i], tokens[j] = merged, None
        next_pos[i] = next_pos[j]
        if next_pos[j] < n:
            prev_pos[next_pos[j]] = i
        # The new piece makes new pairs with its neighbours on both sides.
        left, right = prev_pos[i], next_pos[i]
        if left >= 0 and (new := rank(tokens[left], merged)) is not None:
            heapq.heappush(heap, (new, left))
        if right < n and (new := rank(merged, tokens[right])) is not None:
            heapq.heappush(heap, (new, i))
    return [t for t in tokens if t is not None]
