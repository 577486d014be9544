"""PrefixLRUIndex: capacity accounting that evicts leaves least recently used first."""

from dualpath.storage.index import PrefixLRUIndex


def h(name: str) -> bytes:
    return name.encode().ljust(16, b"\0")


def chain(index: PrefixLRUIndex, names: list[str], nbytes: int = 10,
          parent: str | None = None) -> None:
    """Add ``names`` as a chain (each the parent of the next), under ``parent``."""
    prev = None if parent is None else h(parent)
    for name in names:
        index.add(h(name), prev, nbytes)
        prev = h(name)


def test_total_bytes_accounting():
    index = PrefixLRUIndex(None)
    index.add(h("a"), None, 100)
    index.add(h("b"), h("a"), 30)
    assert (index.total_bytes, len(index)) == (130, 2)
    index.add(h("b"), h("a"), 30)  # known: no double count
    assert (index.total_bytes, len(index)) == (130, 2)
    assert index.remove(h("b"))
    assert (index.total_bytes, len(index)) == (100, 1)
    assert index.remove(h("a"))
    assert (index.total_bytes, len(index)) == (0, 0)


def test_contains_and_remove_unknown():
    index = PrefixLRUIndex(100)
    index.add(h("a"), None, 10)
    assert h("a") in index
    assert h("zz") not in index
    assert index.remove(h("zz")) is False
    assert index.total_bytes == 10
    assert index.remove(h("a")) is True
    assert index.remove(h("a")) is False


def test_is_leaf():
    index = PrefixLRUIndex(None)
    chain(index, ["a", "b", "c"])
    assert [index.is_leaf(h(n)) for n in "abc"] == [False, False, True]
    index.remove(h("c"))
    assert index.is_leaf(h("b"))


def test_no_capacity_never_evicts():
    index = PrefixLRUIndex(None)
    chain(index, [str(i) for i in range(100)], nbytes=1 << 30)
    assert index.victims() == []
    assert len(index) == 100


def test_under_capacity_evicts_nothing():
    index = PrefixLRUIndex(30)
    chain(index, ["a", "b", "c"])
    assert index.total_bytes == 30
    assert index.victims() == []


def test_only_leaves_are_evicted():
    index = PrefixLRUIndex(20)
    chain(index, ["a", "b", "c"])  # a is the oldest, but has children
    index.add(h("x"), None, 10)
    assert index.victims() == [h("c"), h("b")]
    assert h("a") in index and h("x") in index


def test_lru_order_among_leaves():
    index = PrefixLRUIndex(None)
    for name in ["p", "q", "r", "s"]:
        index.add(h(name), None, 10)
    assert index.victims(20) == [h("p"), h("q")]
    assert index.total_bytes == 20


def test_parent_becomes_evictable_after_its_children():
    index = PrefixLRUIndex(None)
    index.add(h("p"), None, 10)  # the oldest block, but a parent
    index.add(h("c1"), h("p"), 10)
    index.add(h("c2"), h("p"), 10)
    index.add(h("y"), None, 10)
    assert index.victims(30) == [h("c1")]
    assert not index.is_leaf(h("p"))
    assert index.victims(20) == [h("c2")]
    assert index.is_leaf(h("p"))
    assert index.victims(10) == [h("p")]
    assert h("y") in index


def test_a_parent_goes_only_when_it_is_the_lru_leaf():
    index = PrefixLRUIndex(None)
    chain(index, ["a", "b"])
    index.add(h("y"), None, 10)
    # b is the LRU leaf; after it goes, a (older than y) is the LRU leaf
    assert index.victims(10) == [h("b"), h("a")]
    assert h("y") in index


def test_touch_changes_order():
    index = PrefixLRUIndex(None)
    for name in ["p", "q", "r"]:
        index.add(h(name), None, 10)
    index.touch(h("p"))
    assert index.victims(20) == [h("q")]
    index.touch(h("r"))
    assert index.victims(10) == [h("p")]
    assert h("r") in index


def test_re_adding_a_known_block_refreshes_it():
    index = PrefixLRUIndex(None)
    for name in ["p", "q"]:
        index.add(h(name), None, 10)
    index.add(h("p"), None, 10)
    assert index.victims(10) == [h("q")]


def test_touch_of_unknown_block_is_ignored():
    index = PrefixLRUIndex(None)
    index.touch(h("nope"))
    assert len(index) == 0 and index.total_bytes == 0


def test_victims_honors_target():
    index = PrefixLRUIndex(1000)
    for i in range(10):
        index.add(h(str(i)), None, 10)
    assert index.victims() == []  # under capacity
    victims = index.victims(75)
    assert victims == [h(str(i)) for i in range(3)]
    assert index.total_bytes == 70
    assert index.victims(70) == []
    assert len(index.victims(0)) == 7
    assert index.total_bytes == 0


def test_victims_defaults_to_capacity():
    index = PrefixLRUIndex(25)
    for i in range(4):
        index.add(h(str(i)), None, 10)
    assert index.victims() == [h("0"), h("1")]
    assert index.total_bytes == 20


def test_victims_are_removed_from_the_index():
    index = PrefixLRUIndex(10)
    chain(index, ["a", "b", "c"])
    victims = index.victims()
    assert victims == [h("c"), h("b")]
    assert all(v not in index for v in victims)
    assert index.is_leaf(h("a"))


def test_eviction_keeps_every_remaining_block_prefixed():
    index = PrefixLRUIndex(60)
    chain(index, ["a0", "a1", "a2", "a3"])
    chain(index, ["b2", "b3"], parent="a1")  # a branch sharing a0, a1
    index.touch(h("a0"))
    index.touch(h("a1"))
    chain(index, ["c0", "c1"])
    victims = index.victims()
    assert len(index) == 6 and index.total_bytes == 60
    parents = {"a1": "a0", "a2": "a1", "a3": "a2", "b2": "a1", "b3": "b2", "c1": "c0"}
    for name, parent in parents.items():
        if h(name) in index:
            assert h(parent) in index, name
    assert h("c0") in index and h("c1") in index
    assert victims == [h("a3"), h("a2")]
