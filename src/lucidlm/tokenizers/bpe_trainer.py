"""The BPE trainer: seed 002's loop (merge the most frequent adjacent pair, repeat), run over
the counts of distinct chunks instead of the raw text, with pair counts kept up to date
incrementally instead of recounted after every merge.

``BPETokenizer.train`` (bpe.py) checks its arguments and builds the tokenizer from the merges
learned here; ``merge_pair`` is the one step training and encoding both take.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Sequence

import regex

from lucidlm.tokenizers.encode_input import split_chunks, split_on_special

Pair = tuple[int, int]


def merge_pair(ids: list[int], pair: Pair, new_id: int) -> list[int]:
    """Replace every non-overlapping occurrence of ``pair`` (left to right) by ``new_id``."""
    out: list[int] = []
    i, n = 0, len(ids)
    first, second = pair
    while i < n:
        if i + 1 < n and ids[i] == first and ids[i + 1] == second:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def count_chunks(text: str, special_tokens: Sequence[str], pattern: str) -> tuple[list[list[int]], list[int]]:
    """(each distinct chunk as its UTF-8 byte ids, how often it occurs). Special tokens are cut
    out first and never counted; the rest is split into ``pattern``'s whole matches, as encode
    splits it. Counting each distinct chunk once matters: "the" occurs thousands of times but
    is one word."""
    split_regex = regex.compile(pattern)
    chunk_counts: Counter[str] = Counter()
    for _, piece, is_special in split_on_special(text, set(special_tokens)):
        if not is_special:
            chunk_counts.update(split_chunks(split_regex, piece))
    words = [list(chunk.encode("utf-8", errors="surrogatepass")) for chunk in chunk_counts]
    return words, list(chunk_counts.values())


def learn_merges(
    words: list[list[int]], freqs: list[int], n_merges: int, progress: bool
) -> list[Pair]:
    """The merge loop. ``words[w]`` is distinct chunk w as ids, seen ``freqs[w]`` times.

    Instead of recounting every pair after every merge (seed 002), keep:
      pair_counts[p]  - occurrences of pair p in the corpus (weighted by chunk frequency)
      where[p]        - ids of the chunks that contain p
      heap            - (-count, left bytes, right bytes, pair): the best pair on top
    A merge only rewrites the chunks in where[p], and only their pairs change count. Heap
    entries are not removed when a count changes; a stale one is skipped when popped.
    """
    from tqdm.auto import tqdm  # local: only training needs it

    vocab: list[bytes] = [bytes([b]) for b in range(256)]  # id -> bytes, grows per merge
    pair_counts: defaultdict[Pair, int] = defaultdict(int)
    where: defaultdict[Pair, set[int]] = defaultdict(set)
    for w, (ids, freq) in enumerate(zip(words, freqs)):
        for pair in zip(ids, ids[1:]):
            pair_counts[pair] += freq
            where[pair].add(w)

    def entry(pair: Pair) -> tuple[int, bytes, bytes, Pair]:
        return (-pair_counts[pair], vocab[pair[0]], vocab[pair[1]], pair)

    heap = [entry(pair) for pair in pair_counts]
    heapq.heapify(heap)

    merges: list[Pair] = []
    bar = tqdm(total=n_merges, desc="BPE merges", unit="merge", disable=not progress)
    while len(merges) < n_merges and heap:
        neg_count, _, _, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue  # stale entry: this pair's count changed after it was pushed
        new_id = 256 + len(merges)
        merges.append(pair)
        vocab.append(vocab[pair[0]] + vocab[pair[1]])

        changed: set[Pair] = set()
        for w in where.pop(pair):
            old = words[w]
            new = merge_pair(old, pair, new_id)
            words[w] = new
            freq = freqs[w]
            # Take the chunk's old pairs out and put its new ones in. Chunks are short, so
            # redoing all of its pairs is simpler than, and about as fast as, a local diff.
            old_pairs, new_pairs = Counter(zip(old, old[1:])), Counter(zip(new, new[1:]))
            for p, n in old_pairs.items():
                pair_counts[p] -= n * freq
                changed.add(p)
                if p not in new_pairs and p != pair:
                    where[p].discard(w)
            for p, n in new_pairs.items():
                pair_counts[p] += n * freq
                changed.add(p)
                where[p].add(w)
        changed.discard(pair)
        del pair_counts[pair]
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, entry(p))
            else:
                del pair_counts[p]
                where.pop(p, None)
        bar.update(1)
    bar.close()
    return merges
