"""``KVCache``'s rows for continuous batching: added (over a reserve, or in new buffers past it),
kept (the ended last rows dropped), and row 0's first slots lent and put back."""

from __future__ import annotations

import torch

from lucidlm.model.kv_cache import KVCache


def filled(rows: int, reserve: int = 0) -> KVCache:
    cache = KVCache(rows, 8, 2, 4, torch.float32, reserve_rows=reserve)
    for name in ("k", "v"):
        getattr(cache, name).copy_(torch.randn(rows, 2, 8, 4))
    return cache


def test_rows_added_keep_the_written_slots_and_start_at_zero():
    for reserve in (0, 2, 5):  # none, too little (new buffers past it), enough (views over it)
        cache = filled(2, reserve)
        before = cache.k.clone(), cache.v.clone()
        base = cache.k.data_ptr()
        cache.add_rows(2, written=5)
        assert cache.batch_size == 4 and cache.k.is_contiguous()
        for now, then in zip((cache.k, cache.v), before):
            assert torch.equal(now[:2, :, :5], then[:, :, :5])  # what was written
            assert not now[2:].any()  # new rows: zeros, never stale values (SDPA weighs masked slots by 0)
        assert (cache.k.data_ptr() == base) == (reserve >= 4)  # within the reserve: no new buffer


def test_kept_rows_are_the_first_and_adding_again_reuses_the_room():
    cache = filled(3, reserve=4)
    first = cache.k[:1].clone()
    cache.v[1:].fill_(float("nan"))  # an ended row's values: must not come back
    cache.keep_rows(1)
    assert cache.batch_size == 1 and torch.equal(cache.k, first)
    cache.add_rows(2, written=8)
    assert cache.batch_size == 3 and torch.equal(cache.k[:1], first) and not cache.v[1:].isnan().any()


def test_row_zeros_first_slots_are_lent_and_put_back():
    cache = filled(2)
    saved = cache.copy_slots(0, 3)
    original = cache.k.clone(), cache.v.clone()
    cache.k[0].zero_()
    cache.v[0].zero_()
    cache.write_slots(0, saved)
    assert torch.equal(cache.k[0, :, :3], original[0][0, :, :3]) and torch.equal(cache.v[0, :, :3], original[1][0, :, :3])
    assert not cache.k[0, :, 3:].any()  # only the lent slots come back
