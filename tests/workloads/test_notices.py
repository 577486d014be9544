"""The shared license file keeps every excerpt's NOTICE when one excerpt is remade."""

from dualpath.workloads.notices import SEPARATOR, split_notices, with_notice

UPSTREAM = "Apache License\nVersion 2.0\n"


def _notice(name: str, body: str) -> str:
    return f"NOTICE for data/{name}\n\n{body}\n"


def test_remaking_one_excerpt_replaces_its_notice_and_keeps_the_others(tmp_path):
    path = tmp_path / "LICENSE-weka"
    path.write_text(with_notice(path, _notice("demo.json", "old demo"), UPSTREAM))
    path.write_text(with_notice(path, _notice("sample.json", "the sample"), UPSTREAM))
    path.write_text(with_notice(path, _notice("demo.json", "new demo"), "ignored: kept upstream"))
    text = path.read_text()
    head, _, tail = text.partition("\n" + SEPARATOR + "\n")
    assert [n.splitlines()[0] for n in split_notices(head)] == [
        "NOTICE for data/demo.json", "NOTICE for data/sample.json"]  # order kept
    assert "new demo" in head and "old demo" not in head and "the sample" in head
    assert tail.strip() == UPSTREAM.strip()


def test_a_notice_with_paragraphs_is_one_block():
    head = _notice("a.json", "first paragraph\n\nsecond paragraph") + "\n" + _notice("b.json", "b")
    blocks = split_notices(head)
    assert len(blocks) == 2 and "second paragraph" in blocks[0]
