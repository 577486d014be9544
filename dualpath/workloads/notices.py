"""The NOTICEs at the head of a shipped excerpt's license file (Apache-2.0 §4(b)).

Several excerpts of one upstream archive share one license file (``LICENSE-weka``): each
excerpt's NOTICE (a paragraph block whose first line is ``NOTICE for <file>``), then a separator
line, then the upstream license. Remaking one excerpt replaces its own NOTICE and keeps the
others, in their order.
"""

from __future__ import annotations

from pathlib import Path

SEPARATOR = "-" * 80
NOTICE_HEADING = "NOTICE for "


def with_notice(path: Path, notice: str, upstream: str) -> str:
    """The text of the license file at ``path`` with ``notice`` in place of the NOTICE that has
    the same first line (appended when there is none); the other NOTICEs and the upstream
    license already there are kept (``upstream`` is used when the file has none)."""
    text = path.read_text() if path.is_file() else ""
    head, sep, tail = text.partition("\n" + SEPARATOR + "\n")
    if not sep:
        head, tail = "", "\n" + upstream
    notices = split_notices(head)
    title = notice.splitlines()[0]
    kept = [n if n.splitlines()[0] != title else notice.strip("\n") for n in notices]
    if title not in (n.splitlines()[0] for n in notices):
        kept.append(notice.strip("\n"))
    return "\n\n".join(kept) + "\n\n" + SEPARATOR + "\n" + tail


def split_notices(head: str) -> list[str]:
    """The NOTICE blocks of a license file's head, each from its ``NOTICE for`` line on."""
    blocks: list[list[str]] = []
    for line in head.strip("\n").splitlines():
        if line.startswith(NOTICE_HEADING) or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    return ["\n".join(b).strip("\n") for b in blocks if "".join(b).strip()]
