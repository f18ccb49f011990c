"""Round 3's refusals where ranks disagree: MPMD jobs (``mpirun -np 1 A : -np 1 B``), one line from rank 0.

Every rank reaches the one agreement whatever it found, so the rank that saw
the problem is named and every rank exits 2 with nothing written. Each job
runs under a time bound; assertions come after it ends.
"""

import time

import pytest

from mpirun import ringtrain, run, show
from ringtrain.cluster.launch import find_mpirun

SMALL = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "1", "--no-progress"]


def mpmd(*sections):
    """``(ranks, command, working directory or None)`` per section, as one mpirun command line."""
    args = [find_mpirun()]
    for i, (ranks, command, wdir) in enumerate(sections):
        args += ([":"] if i else []) + ["-np", str(ranks), *(["-wdir", str(wdir)] if wdir else []), *command]
    return args


def refused(tmp_path, job, needle):
    start = time.monotonic()
    result = run(job, timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringtrain: error: ") and needle in lines[0], show(result)
    assert "Traceback" not in result.stderr + result.stdout and elapsed < 20, show(result)
    assert not (tmp_path / "run").exists(), "something was written"


@pytest.mark.parametrize("layout, rank", [((1, 1), 1), ((2, 1), 2), ((1, 2), 1)])
def test_a_bucket_below_a_byte_on_one_section_is_named_by_rank(tmp_path, layout, rank):
    base = ringtrain("train", *SMALL, "--run-dir", str(tmp_path / "run"))
    job = mpmd((layout[0], base, None), (layout[1], [*base, "--bucket-mb", "1e-7"], None))
    refused(tmp_path, job, f"rank {rank}: --bucket-mb: must be at least 1 byte")


def test_a_fractional_layer_size_in_rank_1s_config_file_is_named(tmp_path):
    for side, hidden in (("a", "[8]"), ("b", "[8.5]")):
        (tmp_path / side).mkdir()
        (tmp_path / side / "run.toml").write_text(f"hidden = {hidden}\n")
    base = ringtrain("train", *SMALL, "--config", "run.toml", "--run-dir", str(tmp_path / "run"))
    job = mpmd((1, base, tmp_path / "a"), (1, base, tmp_path / "b"))
    refused(tmp_path, job, "rank 1: --hidden: expected comma-separated integers like 128,64, got [8.5]")


@pytest.mark.parametrize("ranks", [(1, 1), (2, 1)])
def test_a_path_that_is_not_utf8_on_one_rank_is_named(tmp_path, ranks):
    base = ringtrain("train", *SMALL, "--run-dir", str(tmp_path / "run"))
    job = mpmd((ranks[0], base, None), (ranks[1], [*base, "--timeline", f"{tmp_path}/t-\udcff.json"], None))
    refused(tmp_path, job, f"rank {ranks[0]}: --timeline: b'")
