"""The horovodrun -> ringtrain launch table on docs/horovod.md names only flags that ringtrain launch takes.

Where the table says ringtrain takes "the same flags", each of horovodrun's flags in that row must
be one of `ringtrain launch`'s options; every other flag the ringtrain column shows must be one too.
Read from the page and ringtrain's own parser, no MPI.
"""

import argparse
import os
import re

from markdown_pages import read

SECTION = "## From horovodrun to `ringtrain launch`"


def _rows():
    text = read(os.path.join("docs", "horovod.md"))
    assert SECTION in text, f"docs/horovod.md lost its section {SECTION!r}"
    rows = []
    for line in text.split(SECTION, 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and not set(cells[0]) <= set("-") and cells[0] != "horovodrun":
            rows.append(cells)
    return rows


def _flags(cell):
    """The option words in a cell's code spans (``-np 4`` -> -np), up to a ``--`` that starts the command."""
    found = []
    for span in re.findall(r"`([^`]+)`", cell):
        words = span.split()
        words = words[:words.index("--")] if "--" in words else words
        found += [word for word in words if re.fullmatch(r"--?[a-zA-Z][\w-]*", word)]
    return found


def _launch_options():
    from ringtrain.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for action in sub.choices["launch"]._actions for flag in action.option_strings}


def test_the_table_covers_horovodruns_everyday_flags():
    shown = {flag for horovodrun, _, _ in _rows() for flag in _flags(horovodrun)}
    assert {"-np", "-H", "--hostfile", "--min-np", "--max-np", "--host-discovery-script", "-x", "--verbose"} <= shown


def test_every_flag_the_ringtrain_column_shows_is_one_launch_takes():
    options, wrong = _launch_options(), []
    for horovodrun, ringtrain, _ in _rows():
        claimed = _flags(horovodrun) if ringtrain.startswith("the same flag") else []
        wrong += [(horovodrun, f) for f in claimed + _flags(ringtrain) if f not in options]
    assert wrong == [], f"flags ringtrain launch does not take: {wrong}"
