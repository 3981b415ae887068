"""Doc lint of docs/engine-path.md's citation table (`| we rely on | upstream file:line @ commit |`).

The rule: each row's citation cell either
  - cites a file at lines and a commit in one citation: a path (in backticks, or bare with an extension)
    followed by `:` and digits, and then, before the next `;` outside parentheses, `@ <commit>` where the
    commit is 7 to 40 hex digits; one such citation per row is enough (others in the row may be looser); or
  - starts with `not resolved:` or `absence:` followed by what was not found, saying plainly that no
    line/commit is given (an absence has no line).
A row with neither fails, naming the row. Also: a short commit cited in the table whose full 40-hex form
is in dflash_trt/trtllm/api_snapshot.json is spelled out in full somewhere in the doc (a "Commits" line).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "engine-path.md"
SNAPSHOT = ROOT / "dflash_trt" / "trtllm" / "api_snapshot.json"
HEADER = "| we rely on | upstream file:line @ commit |"

FILE_LINES = re.compile(r"(?:`[^`\s]+`|[\w./-]+\.\w+):\d+")
AT_COMMIT = re.compile(r"@ ?([0-9a-f]{7,40})\b")
EXEMPT = re.compile(r"^(not resolved|absence):\s*\S")


def table_rows(text: str) -> list[tuple[str, str]]:
    """(claim, citation) of each row of the citation table."""
    lines = text.splitlines()
    start = lines.index(HEADER)
    assert re.fullmatch(r"\|-+\|-+\|", lines[start + 1]), lines[start + 1]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        assert len(cells) == 2, f"not a two-cell row: {line}"
        rows.append((cells[0], cells[1]))
    return rows


def citations(cell: str) -> list[str]:
    """The cell split at `;` outside parentheses (a `;` inside a parenthesised remark does not end a citation)."""
    parts, depth, current = [], 0, ""
    for ch in cell:
        depth += (ch == "(") - (ch == ")")
        if ch == ";" and depth <= 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [*parts, current]


def row_problem(citation: str) -> str | None:
    """None when the citation cell follows the rule in the module docstring, else what is missing."""
    if EXEMPT.match(citation):
        return None
    for part in citations(citation):
        m = FILE_LINES.search(part)
        if m and AT_COMMIT.search(part, m.end()):
            return None
    has_lines, has_commit = bool(FILE_LINES.search(citation)), bool(AT_COMMIT.search(citation))
    if not has_lines and not has_commit:
        return "neither a file:lines nor an @ commit (nor a `not resolved:` / `absence:` prefix)"
    if not has_lines:
        return "no file:lines (nor a `not resolved:` / `absence:` prefix)"
    if not has_commit:
        return "no @ <hex commit> (nor a `not resolved:` / `absence:` prefix)"
    return "no citation with file:lines and its @ <hex commit> together"


def test_every_row_cites_file_lines_at_a_commit_or_says_what_is_unresolved():
    rows = table_rows(DOC.read_text())
    assert len(rows) >= 20  # the parser found the table, not a stub of it
    problems = [f"{claim[:70]!r}: {p}" for claim, cite in rows if (p := row_problem(cite))]
    assert not problems, "\n".join(problems)


def test_the_rule_fails_a_row_without_either():
    assert row_problem("`a/b.cpp`:10-20 @ 0123abcd") is None
    assert row_problem("`a/b.cpp`:10-20 (`f`; see 12) @ 0123abcd") is None  # `;` inside parentheses
    assert row_problem("`a/b.h` @ 0123abcd; `c.cpp`:5 @ 89abcdef") is None  # one full citation is enough
    assert row_problem("not resolved: `a/b.h` read only in another tree") is None
    assert row_problem("absence: no such member in `executor.h`") is None
    assert row_problem("`a/b.cpp` (read, not counted)") is not None  # neither
    assert row_problem("`a/b.cpp`:10-20") is not None  # no commit
    assert row_problem("`a/b.cpp` @ 0123abcd") is not None  # no lines
    assert row_problem("`a/b.cpp`:10 @ v10.14") is not None  # a tag is not a hex commit
    assert row_problem("`a/b.cpp`:10; `c.h` @ 0123abcd") is not None  # lines and commit of different files
    assert row_problem("see notes; not resolved: x") is not None  # the prefix starts the cell


def test_short_commits_with_a_known_full_hash_are_spelled_out():
    text = DOC.read_text()
    full = set(re.findall(r"\b[0-9a-f]{40}\b", SNAPSHOT.read_text())) | set(re.findall(r"\b[0-9a-f]{40}\b", text))
    json.loads(SNAPSHOT.read_text())  # the snapshot parses (its hashes are read as text above)
    cited = {c for _, cite in table_rows(text) for c in AT_COMMIT.findall(cite)}
    missing = sorted(short for short in cited if len(short) < 40
                     for h in full if h.startswith(short) and h not in text)
    assert not missing, f"full hashes known but not in the doc: {missing}"
