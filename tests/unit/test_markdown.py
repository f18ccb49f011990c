"""The README and every docs page render as written under CommonMark: headings, fences, tables, lists."""

import pytest

from markdown_pages import SOURCES, fences, problems, read, require

require("markdown_it", "pip install markdown-it-py, or the [test] extra")

# Lines 44-53 of the README before 0.3.0: a closing fence with text after it, which GitHub and PyPI
# rendered as code from there on, and the headings below it as code too.
BROKEN_README = """\
```bash
. .venv/bin/activate            # or call them by path
mpirun -np 2 ringtrain info
``` On a cluster, use the system MPI instead (see
[Running on a cluster](#running-on-a-cluster)).

## How it works

| idea | where |
|---|---|
| Task spec from MPI | `cluster/topology.py` |

```
ringtrain/
```
"""


@pytest.mark.parametrize("page", SOURCES)
def test_page_renders_as_written(page):
    assert problems(read(page)) == [], page


@pytest.mark.parametrize("page", SOURCES)
def test_every_fence_names_its_language(page):
    """So that no block escapes the tests: python runs, bash is parsed, text is output."""
    unnamed = [fence.line for fence in fences(read(page)) if not fence.lang]
    assert unnamed == [], f"{page}: fences without a language at lines {unnamed} (use text for output)"


def test_the_old_readme_fails():
    found = problems(BROKEN_README)
    assert any("text after a closing fence" in p for p in found), found
    assert any("'## How it works' does not render as a heading" in p for p in found), found


def test_a_good_page_passes():
    good = "# Title\n\nSome text.\n\n```bash\necho hi\n```\n\n## Next\n\n- a\n- b\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert problems(good) == []


@pytest.mark.parametrize("text, expected", [
    ("##Heading\n", "put a space after the #"),
    ("Title\n---\n", "renders as a heading"),
    ("Some text.\n| a | b |\n|---|---|\n| 1 | 2 |\n", "a table right after a paragraph"),
    ("| a | b |\n| 1 | 2 |\n", "does not render in a table"),
    ("Some text:\n- a\n- b\n", "a list right after a paragraph"),
    ("Text.\n\n    indented\n", "indented text renders as code"),
    ("```bash\necho hi\n", "a fence that never closes"),
    ("  ```bash\n  echo hi\n  ```\n", "an indented fence"),
    ("```bash {.copy}\necho\n```\n", "more than a language"),
])
def test_each_way_to_break_a_page_is_named(text, expected):
    found = problems(text)
    assert any(expected in p for p in found), found


def test_fences_as_written():
    text = "<!-- docs-test: after `ringtrain train --epochs 1` -->\n```python\nprint(1)\n```\n\n```toml\na = 1\n```\n"
    assert fences(text) == [("python", "print(1)\n", 2, "ringtrain train --epochs 1"), ("toml", "a = 1\n", 6, None)]
