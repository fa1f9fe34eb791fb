from __future__ import annotations

import pytest
import torch

from batchrun.engine.allocator import TokenAllocator


def test_allocate_free_page_size_1() -> None:
    alloc = TokenAllocator(8)
    assert alloc.capacity == 8 and alloc.num_free == 8
    a = alloc.allocate(3)
    assert a is not None and a.dtype == torch.int64 and a.device.type == "cpu"
    assert a.tolist() == [0, 1, 2]
    b = alloc.allocate(5)
    assert b is not None and sorted(b.tolist()) == [3, 4, 5, 6, 7]
    assert alloc.num_free == 0
    assert alloc.allocate(1) is None
    alloc.free(a)
    assert alloc.num_free == 3
    c = alloc.allocate(3)
    assert c is not None and sorted(c.tolist()) == [0, 1, 2]
    alloc.check_no_double_free()


def test_allocate_zero_and_empty_free() -> None:
    alloc = TokenAllocator(4)
    z = alloc.allocate(0)
    assert z is not None and z.numel() == 0
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.num_free == 4


def test_shortfall_allocates_nothing() -> None:
    alloc = TokenAllocator(8)
    assert alloc.allocate(6) is not None
    assert alloc.allocate(3) is None
    assert alloc.num_free == 2
    assert alloc.allocate(2) is not None


def test_page_size_4() -> None:
    alloc = TokenAllocator(16, page_size=4)
    a = alloc.allocate(8)
    assert a is not None and a.tolist() == list(range(8))
    b = alloc.allocate(4)
    assert b is not None and b.tolist() == [8, 9, 10, 11]
    alloc.free(a[4:])  # page 1 only
    assert alloc.num_free == 8
    c = alloc.allocate(8)
    assert c is not None
    # Whole pages, page-contiguous.
    pages = c.view(-1, 4)
    assert (pages[:, 0] % 4 == 0).all() and (pages - pages[:, :1] == torch.arange(4)).all()
    assert sorted(set(c.tolist()) | set(b.tolist()) | set(a[:4].tolist())) == list(range(16))
    assert alloc.num_free == 0
    alloc.check_no_double_free()


def test_unaligned_raises() -> None:
    with pytest.raises(ValueError):
        TokenAllocator(10, page_size=4)
    alloc = TokenAllocator(16, page_size=4)
    with pytest.raises(ValueError):
        alloc.allocate(3)
    a = alloc.allocate(4)
    assert a is not None
    with pytest.raises(ValueError):
        alloc.free(a[:2])


def test_exhaustion_and_refill_many_chunks() -> None:
    alloc = TokenAllocator(1000)
    chunks = [alloc.allocate(10) for _ in range(100)]
    assert alloc.allocate(1) is None
    for c in chunks[::2]:
        alloc.free(c)
    assert alloc.num_free == 500
    big = alloc.allocate(500)  # spans many lazily merged freed chunks
    assert big is not None and big.unique().numel() == 500
    alloc.check_no_double_free()


def test_double_free_detected_by_check() -> None:
    alloc = TokenAllocator(8)
    a = alloc.allocate(4)
    assert a is not None
    alloc.free(a[:2])
    alloc.free(a[:2])
    with pytest.raises(AssertionError, match="double free"):
        alloc.check_no_double_free()


def test_double_free_debug_raises_immediately() -> None:
    alloc = TokenAllocator(8, page_size=2, debug=True)
    a = alloc.allocate(4)
    assert a is not None
    alloc.free(a[:2])
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(a[:2])
    with pytest.raises(AssertionError):
        alloc.free(torch.tensor([1, 2]))  # not page-aligned


def test_free_beyond_capacity_always_caught() -> None:
    alloc = TokenAllocator(4)
    a = alloc.allocate(4)
    assert a is not None
    alloc.reset()
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(a)


def test_free_does_not_alias_caller_buffer() -> None:
    alloc = TokenAllocator(4)
    a = alloc.allocate(2)
    assert a is not None
    alloc.free(a)
    a.fill_(99)  # caller reuses its buffer
    b = alloc.allocate(4)
    assert b is not None and sorted(b.tolist()) == [0, 1, 2, 3]


def test_reset() -> None:
    alloc = TokenAllocator(8, page_size=2)
    assert alloc.allocate(6) is not None
    alloc.reset()
    assert alloc.num_free == 8
    alloc.check_no_double_free()
