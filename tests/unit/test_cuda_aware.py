"""CUDA-aware MPI detection: the verdict from the environment and from the library's own query."""

import pytest

from ringtrain.comm.cuda_aware import ENV, cuda_aware, verdict
from ringtrain.errors import UsageError


@pytest.mark.parametrize("override, query, expected", [
    (None, 1, (True, "MPIX_Query_cuda_support() returned 1")),
    (None, 0, (False, "MPIX_Query_cuda_support() returned 0")),
    (None, None, (False, "this MPI does not export MPIX_Query_cuda_support")),
    ("1", 0, (True, f"{ENV}=1")),     # the override wins over the library
    ("0", 1, (False, f"{ENV}=0")),
    (" 1 ", None, (True, f"{ENV}=1")),
])
def test_verdict(override, query, expected):
    assert verdict(override, query) == expected


@pytest.mark.parametrize("bad", ["yes", "", "2", "true"])
def test_a_bad_override_is_one_line_naming_the_variable(bad):
    with pytest.raises(UsageError, match=f"{ENV}=.*expected 0 or 1"):
        verdict(bad, None)


def test_this_machines_mpi_is_asked_through_its_own_library():
    # The MPICH wheel exports MPIX_Query_cuda_support and, built without CUDA, says 0.
    aware, why = cuda_aware(environ={})
    assert why.startswith("MPIX_Query_cuda_support() returned") or why.startswith("this MPI does not export")
    assert aware == why.endswith("returned 1")
    assert cuda_aware(environ={ENV: "1"}) == (True, f"{ENV}=1")
