"""The rank-order kernel's CUDA source, generated and checked without CuPy or a GPU.

The source is evaluated here by translating its C into Python: the same
statements in the same order, on NumPy scalars, against NumPy's own
``minimum``/``maximum``/``add`` folded over the ranks in rank order.
"""

import functools
import re

import numpy as np
import pytest

from ringtrain.backend import rank_order_source


def run_source(body, operands):
    """Evaluate the kernel body (``T a = x0; a = (c) ? a : x1; ... y = a;``) on NumPy scalars."""
    py = body.replace("T a = ", "a = ").replace("||", " or ")
    py = re.sub(r"\(([^()]*)\) \? a : (x\d+);", r"a if (\1) else \2;", py)
    namespace = {f"x{i}": v for i, v in enumerate(operands)}
    for statement in filter(None, (s.strip() for s in py.split(";"))):
        exec(statement, {}, namespace)  # noqa: S102 - our own generated source, in a test
    return namespace["y"]


@pytest.mark.parametrize("combine", ["add", "minimum", "maximum"])
def test_the_source_grows_linearly_with_the_rank_count(combine):
    # It used to paste the running expression four times per rank: 202 KB at 8 ranks, 52 MB at 12.
    lengths = [len("".join(rank_order_source(n, combine))) for n in (2, 4, 8, 16, 64)]
    per_rank = (lengths[-1] - lengths[0]) / 62
    assert all(length < 40 + 60 * n for length, n in zip(lengths, (2, 4, 8, 16, 64)))
    assert lengths == sorted(lengths) and per_rank < 60


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("combine", ["minimum", "maximum"])
def test_min_and_max_follow_numpy_with_nan_in_rank_order(combine, n):
    rng = np.random.default_rng(n)
    for trial in range(20):
        operands = list(rng.standard_normal(n).astype(np.float32))
        if trial % 3 == 0:
            operands[rng.integers(n)] = np.float32("nan")
        want = functools.reduce(getattr(np, combine), operands)
        got = run_source(rank_order_source(n, combine)[1], operands)
        assert np.array_equal(np.float32(got), np.float32(want), equal_nan=True)


def test_the_sum_adds_left_to_right():
    inputs, body = rank_order_source(4, "add")
    assert inputs == "T x0, T x1, T x2, T x3" and body == "y = x0 + x1 + x2 + x3;"


@pytest.mark.parametrize("name", ["multiply", "cupy_add", "max"])
def test_any_other_combine_is_an_error_not_a_silent_max(name):
    with pytest.raises(ValueError, match=f"unknown combine '{name}'; choose one of add, maximum, minimum"):
        rank_order_source(3, name)
