"""JSON Lines files, read with ``file:line`` errors and written atomically (standard library only: a script that
reads them imports no torch).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def json_lines(path: str | Path, error: type[Exception] = ValueError, cut_tail: bool = False
               ) -> Iterator[tuple[int, object]]:
    """``(line number, value)`` of every non-blank line of the UTF-8 JSONL file ``path``.

    Args:
        error: raised as ``error("file:line: not JSON (reason)")`` for a line that does not parse.
        cut_tail: a last line that does not parse and has no newline ends the file quietly (cut by a killed writer).
    """
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                if cut_tail and n > 1 and not line.endswith("\n"):
                    return
                raise error(f"{path}:{n}: not JSON ({exc.msg})") from None
            yield n, value


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object a line (UTF-8, keys in their order), written to ``path.tmp`` and renamed over ``path``."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False, sort_keys=False) + "\n")
    tmp.replace(path)
