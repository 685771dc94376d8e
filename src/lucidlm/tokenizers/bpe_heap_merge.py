"""The O(n log n) BPE merge for long chunks: same ids as the simple lowest-rank-first loop.

``BPETokenizer`` merges an ordinary chunk (a word) with a simple loop that rescans every pair
after every merge; for a chunk over ``bpe._LONG_CHUNK`` bytes (a base64 blob, a DNA string)
that is quadratic, so it hands the chunk to ``merge_by_heap`` here.
"""

from __future__ import annotations

import heapq

from lucidlm.tokenizers.bpe_trainer import Pair


def merge_by_heap(ids: list[int], merge_id: dict[Pair, int]) -> list[int]:
    """BPE-encode ``ids`` with ``merge_id`` (pair -> new id = 256 + rank): the simple loop's result in O(n log n).

    A long chunk (a base64 blob, a DNA string) makes rescanning every pair after every
    merge quadratic. Here a heap holds (merge id, position) for every mergeable pair
    and the tokens form a linked list. Popping in (id, position) order merges the
    earliest-learned pair first and its occurrences left to right - exactly what the
    simple loop does - because a merge only creates pairs with larger ids.
    """
    n = len(ids)
    tokens: list[int | None] = list(ids)  # None: merged into its left neighbour
    next_pos = list(range(1, n + 1))  # n means "no next token"
    prev_pos = list(range(-1, n - 1))  # -1 means "no previous token"
    pairs = enumerate(zip(ids, ids[1:]))
    heap = [(merge_id[pair], i) for i, pair in pairs if pair in merge_id]
    heapq.heapify(heap)
    while heap:
        new_id, i = heapq.heappop(heap)
        j = next_pos[i]
        if tokens[i] is None or j == n or merge_id.get((tokens[i], tokens[j])) != new_id:
            continue  # stale: a neighbour changed since this entry was pushed
        tokens[i], tokens[j] = new_id, None
        next_pos[i] = next_pos[j]
        if next_pos[j] < n:
            prev_pos[next_pos[j]] = i
        # The new token makes new pairs with its neighbours on both sides.
        left, right = prev_pos[i], next_pos[i]
        if left >= 0 and (tokens[left], new_id) in merge_id:
            heapq.heappush(heap, (merge_id[(tokens[left], new_id)], left))
        if right < n and (new_id, tokens[right]) in merge_id:
            heapq.heappush(heap, (merge_id[(new_id, tokens[right])], i))
    return [t for t in tokens if t is not None]
