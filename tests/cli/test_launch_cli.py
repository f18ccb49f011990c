"""``ringtrain launch`` as a user runs it: real mpirun on this host."""

import os
import sys

import pytest

from mpirun import ringtrain, run, show
from mpirun import test_env as job_env

# One write per line: unbuffered print() writes its pieces separately, and
# ranks sharing mpirun's stdout would interleave them.
PRINT_RANK = ("import os; from ringtrain.cluster.rank_log import rank_from_env; r = rank_from_env(os.environ); "
              "os.write(1, f'rank {r}\\n'.encode()); os.write(2, f'err {r}\\n'.encode())")


def test_runs_the_command_on_every_rank_and_prints_the_mpi_command():
    result = run(ringtrain("launch", "-np", "3", "--", sys.executable, "-c", PRINT_RANK), timeout=60)
    assert result.returncode == 0, show(result)
    assert sorted(result.stdout.split("\n")[:-1]) == ["rank 0", "rank 1", "rank 2"]
    first = result.stderr.splitlines()[0]
    assert first.startswith("ringtrain launch: ") and " -np 3 " in first, show(result)


def test_per_rank_logs(tmp_path):
    logs = tmp_path / "logs"
    result = run(ringtrain("launch", "-np", "3", "-o", str(logs), "--", sys.executable, "-c", PRINT_RANK), timeout=60)
    assert result.returncode == 0, show(result)
    assert sorted(p.name for p in logs.iterdir()) == ["rank-0.log", "rank-1.log", "rank-2.log"]
    for r in range(3):
        assert sorted((logs / f"rank-{r}.log").read_text().splitlines()) == [f"err {r}", f"rank {r}"]
    assert "rank " not in result.stdout


def test_the_jobs_exit_status_comes_back():
    code = ("import os, sys; from ringtrain.cluster.rank_log import rank_from_env; "
            "sys.exit(3 if rank_from_env(os.environ) == 1 else 0)")
    result = run(ringtrain("launch", "-np", "3", "--", sys.executable, "-c", code), timeout=60)
    assert result.returncode == 3, show(result)


def test_a_hostfile_for_this_machine_in_either_syntax(tmp_path):
    for text in ("# this machine\nlocalhost slots=2\n", "localhost:2  # this machine\n"):
        hostfile = tmp_path / "hosts"
        hostfile.write_text(text)
        result = run(ringtrain("launch", "-np", "2", "--hostfile", str(hostfile), "--", *ringtrain("info")), timeout=60)
        assert result.returncode == 0, show(result)
        assert "2 rank(s) on 1 node(s)" in result.stdout


def test_a_bad_hostfile_is_one_line_exit_2_and_nothing_is_written(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode0:2\nnode1 slots=x\n")
    logs = tmp_path / "logs"
    result = run(ringtrain("launch", "-np", "2", "--hostfile", str(hostfile), "-o", str(logs), "--", "true"),
                 timeout=60)
    assert result.returncode == 2, show(result)
    assert result.stderr == ("ringtrain: error: hostfile line 3: expected 'host slots=N' or 'host:N', "
                             "got 'node1 slots=x'\n")
    assert result.stdout == "" and not logs.exists()


def test_too_few_slots_and_a_missing_command_are_usage_errors():
    for args in (["-np", "5", "-H", "a:2,b:2", "--", "true"], ["-np", "2", "--"], ["-np", "2", "--bogus"]):
        result = run(ringtrain("launch", *args), timeout=60)
        assert result.returncode == 2, show(result)
        assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, show(result)


def test_dry_run_prints_the_command_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    result = run(ringtrain("launch", "-np", "2", "-H", "h1:1,h2:1", "--dry-run", "--", "touch", str(marker)),
                 timeout=60)
    assert result.returncode == 0, show(result)
    assert result.stdout.endswith(f" -np 2 touch {marker}\n") and "h1:1,h2:1" in result.stdout
    assert not marker.exists()


def test_bad_inputs_are_one_line_exit_2_never_a_traceback_or_a_hang(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [
        (["-np", "99999999999999"], "-np 99999999999999 is above ringtrain launch's limit"),
        (["-np", str(64 * os.cpu_count() + 1)], f"-np {64 * os.cpu_count() + 1} is more than "),
        (["-np", "0"], "number of processes must be at least 1, got 0"),
        (["-np", "2", "-o", str(afile / "logs")], f"-o {afile}/logs: {afile} is not a directory"),
        (["-np", "2", "-o", "/proc/no/logs"], "-o /proc/no/logs: cannot "),
        (["-np", "2", "--hostfile", str(fifo)], f"cannot read hostfile '{fifo}': it is a FIFO (named pipe)"),
        (["-np", "2", "--hostfile", str(tmp_path)], f"cannot read hostfile '{tmp_path}': it is a directory"),
        (["-np", "2", "--hostfile", "/dev/zero"], "cannot read hostfile '/dev/zero': it is a character device"),
    ]
    for args, message in cases:
        result = run(ringtrain("launch", *args, "--", "true"), timeout=30)
        assert result.returncode == 2, show(result)
        assert result.stderr.startswith(f"ringtrain: error: {message}"), show(result)
        assert len(result.stderr.splitlines()) == 1 and result.stdout == "", show(result)


@pytest.mark.parametrize("program", ["", "  "])
@pytest.mark.parametrize("flags", [["--dry-run"], [], ["--dry-run", "-H", "localhost:1"],
                                   ["--dry-run", "--min-np", "1"], ["--min-np", "1"]])
def test_an_empty_program_name_is_refused_in_one_line_dry_run_too(tmp_path, program, flags):
    logs = tmp_path / "logs"
    result = run(ringtrain("launch", "-np", "1", *flags, "-o", str(logs), "--", program, "x"), timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert f"the command after '--' is {program!r}, an empty program name" in result.stderr, show(result)
    assert result.stdout == "" and not logs.exists(), show(result)


def without_slurm(**extra):
    """The test environment with no Slurm variable but ``extra``: as a job script's leftover might set it."""
    env = {k: v for k, v in job_env().items() if not k.startswith("SLURM_")}
    env.update(extra)
    return env


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_slurm_job_id_without_its_node_list_is_named_not_called_outside_an_allocation(dry_run):
    result = run(ringtrain("launch", *dry_run, "--", "true"), timeout=60, env=without_slurm(SLURM_JOB_ID="7"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    line = result.stderr.strip()
    assert "outside a Slurm allocation" not in line, show(result)
    for words in ("SLURM_JOB_ID=7 is set but neither SLURM_JOB_NODELIST nor SLURM_NODELIST is", "give -np N",
                  "unset SLURM_JOB_ID"):
        assert words in line, show(result)
    with_hosts = run(ringtrain("launch", *dry_run, "-H", "localhost:1", "--", "true"), timeout=60,
                     env=without_slurm(SLURM_JOB_ID="7"))
    assert with_hosts.returncode == 2 and "-np N is required with --hostfile or -H, inside Slurm job 7 too" \
        in with_hosts.stderr, show(with_hosts)
    outside = run(ringtrain("launch", *dry_run, "--", "true"), timeout=60, env=without_slurm())
    assert outside.returncode == 2 and "-np N is required outside a Slurm allocation" in outside.stderr, show(outside)


LONG_NAME = "n" * 254  # one past the longest name DNS allows


@pytest.mark.parametrize("elastic", [[], ["--min-np", "1"]])
@pytest.mark.parametrize("source, entry, said", [
    ("-H", "node1:" + "x" * 5000, "-H entry 1: expected 'host slots=N' or 'host:N', got 'node1:xxx"),
    ("-H", LONG_NAME + ":1", "-H entry 1: a host name of 254 characters (at most 253), got 'nnn"),
    ("-H", LONG_NAME, "-H entry 1: a host name of 254 characters (at most 253)"),
    ("hostfile", "node1 slots=" + "x" * 5000, "hostfile line 1: expected 'host slots=N' or 'host:N', got 'node1 slot"),
    ("hostfile", LONG_NAME + " slots=1", "hostfile line 1: a host name of 254 characters (at most 253)"),
    ("hostfile", LONG_NAME + ":2", "hostfile line 1: a host name of 254 characters (at most 253)"),
])
def test_hosts_entries_are_quoted_short_and_names_past_253_characters_refused(tmp_path, elastic, source, entry,
                                                                             said):
    if source == "hostfile":
        (tmp_path / "hosts").write_text(entry + "\n")
        hosts = ["--hostfile", str(tmp_path / "hosts")]
    else:
        hosts = ["-H", entry]
    result = run(ringtrain("launch", "-np", "1", *elastic, "--dry-run", *hosts, "--", "true"), timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    line = result.stderr.strip()
    assert said in line and len(line) < 400, show(result)
    assert "x" * 100 not in line and "n" * 100 not in line, show(result)
