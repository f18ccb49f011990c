"""The documentation's Markdown, read two ways: the fences as written, and the blocks as they render.

:data:`PAGES` is the README and every page of the site; :data:`SOURCES` adds the sections waiting
in ``docs/incoming/`` (not published, but their code and Markdown are checked all the same).
:func:`fences` finds the code blocks the way an author writes them: a line of three backticks and a
language opens one, a line of three backticks alone closes it. :func:`problems` renders the text
with a CommonMark parser (markdown-it-py, as GitHub and PyPI render the README) and names every
place where the two readings differ: a fence that does not close where it was meant to (text after
a closing fence), a heading that renders as something else, a table or a list that renders as a
paragraph. Pure functions, no MPI.
"""

import glob
import importlib.util
import os
import re
from collections import namedtuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ALL = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
PAGES = ["README.md"] + [p for p in _ALL if not p.startswith(os.path.join("docs", "incoming", ""))]
# What the code and Markdown tests read: the pages, and the sections waiting in docs/incoming/ to be merged.
SOURCES = PAGES + [p for p in _ALL if p not in PAGES]

Fence = namedtuple("Fence", "lang code line marker")   # line: 1-based line of the opening fence

OPEN = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
CLOSE = re.compile(r"^```\s*$")
# An HTML comment right before a block: run a command first, or only compile the block.
MARKER = re.compile(r"^<!-- (?:readme|docs)-test: (?P<what>after `(?P<after>[^`]+)`|parse) -->\s*$")


def read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def fences(text):
    """The code blocks as written: [Fence], each from its opening line to the next bare closing line."""
    lines, found, i = text.split("\n"), [], 0
    while i < len(lines):
        opened = OPEN.match(lines[i])
        if not opened:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        marker = MARKER.match(lines[i - 1]) if i else None
        code = "\n".join(lines[i + 1:end]) + "\n"
        found.append(Fence(opened["lang"], code, i + 1, marker and (marker["after"] or "parse")))
        i = end + 1
    return found


def _fence_spans(lines):
    """[(first, last)] 0-based line spans of the fences as written, and problems with the fence lines."""
    spans, problems, start = [], [], None
    for n, line in enumerate(lines):
        if start is None:
            if line.startswith("```"):
                if OPEN.match(line):
                    start = n
                else:
                    problems.append(f"line {n + 1}: a fence opens with more than a language: {line!r}")
            elif line.lstrip().startswith("```"):
                problems.append(f"line {n + 1}: an indented fence; start fences at the beginning of the line")
        elif line.startswith("```"):
            if not CLOSE.match(line):
                problems.append(f"line {n + 1}: text after a closing fence ({line!r}); "
                                "put it on a line of its own")
            spans.append((start, n))
            start = None
    if start is not None:
        problems.append(f"line {start + 1}: a fence that never closes")
    return spans, problems


def problems(text):
    """Where ``text`` does not render as written, one line each (empty when it renders as meant)."""
    from markdown_it import MarkdownIt

    lines = text.split("\n")
    spans, found = _fence_spans(lines)
    in_fence = set()
    for first, last in spans:
        in_fence.update(range(first, last + 1))
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    rendered = {(t.map[0], t.map[1] - 1) for t in tokens if t.type == "fence"}
    for first, last in sorted(set(spans) - rendered):
        found.append(f"line {first + 1}: this fence does not render as one block from line {first + 1} "
                     f"to line {last + 1}")
    for first, last in sorted(rendered - set(spans)):
        found.append(f"line {first + 1}: a code block renders from line {first + 1} to line {last + 1}, "
                     "which is not how it is written")
    headings = {t.map[0]: t for t in tokens if t.type == "heading_open"}
    tables = set()
    for t in tokens:
        if t.type == "table_open":
            tables.update(range(t.map[0], t.map[1]))
            if t.map[0] > 0 and lines[t.map[0] - 1].strip():
                found.append(f"line {t.map[0] + 1}: a table right after a paragraph; put a blank line before "
                             "it (mkdocs' Markdown reads it as text otherwise)")
        if t.type == "code_block":
            found.append(f"line {t.map[0] + 1}: indented text renders as code; unindent it or fence it")
        if t.type in ("bullet_list_open", "ordered_list_open") and t.level == 0 and t.map[0] > 0:
            above = lines[t.map[0] - 1]
            if above.strip() and not above.startswith("#"):
                found.append(f"line {t.map[0] + 1}: a list right after a paragraph; put a blank line before "
                             "it (mkdocs' Markdown reads it as text otherwise)")
    for n, line in enumerate(lines):
        if n in in_fence:
            continue
        if re.match(r"#{1,6}(\s|$)", line):
            token = headings.get(n)
            if token is None or not token.markup.startswith("#"):
                found.append(f"line {n + 1}: {line!r} does not render as a heading")
        elif re.match(r"#{1,6}[^#\s]", line):
            found.append(f"line {n + 1}: {line!r} is not a heading; put a space after the #")
        elif line.startswith("|") and n not in tables:
            found.append(f"line {n + 1}: a table row that does not render in a table; "
                         "put a blank line before the table")
    for n, token in headings.items():
        if not token.markup.startswith("#"):
            found.append(f"line {n + 1}: the text above a line of {token.markup!r} renders as a heading; "
                         "put a blank line between them")
    return found


def require(module, install):
    """Skip, saying why, where ``module`` is missing; under CI (CI set) fail instead, since CI installs it."""
    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is not installed, and CI must run this test: {install}", pytrace=False)
        pytest.skip(f"{module} is not installed ({install})", allow_module_level=True)
