"""Every environment variable ringtrain reads, found by reading the source, fed garbage through a real entry point.

A static check parses ``ringtrain/**/*.py`` and lists each variable the package reads (a name passed to
``env.get``/``os.environ``/``getenv``/``env_int``/``env_seconds``/``env_flag``, a module constant named like
``ENV*``/``*VARIABLES`` that holds names, and any string of a launcher's family of names). Each must be in
:data:`VARIABLES`, which says how it is exercised: a variable added without a line there fails the test.

Each number (or switch) is then given the garbage of :data:`GARBAGE` where ringtrain reads it:

* the command line in this process (``ringtrain.cli.main``: ``train``, ``launch --dry-run``, ``info``), every
  value of the table, since each refusal comes before any rank would wait (one process, many cases);
* ``import ringtrain.torch as hvd; hvd.init()`` in a child per case of one program that imports torch once;
* and samples of both under ``mpirun -np 2``, one rank given a bad value alone (MPMD) among them.

Each must end in exit status 2 with one line naming the variable, no traceback, and nothing written.
"""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

import mpirun
from mpirun import ROOT, run, show
from refusals import snapshot
from ringtrain import cli
from ringtrain.cluster.launch import find_mpirun
from ringtrain.engine.runtime import UNSERVED

PACKAGE = os.path.join(ROOT, "ringtrain")
HVD_PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "hvd_environment.py")
SMALL = ["--dataset", "synthetic", "--samples", "100", "--features", "4", "--classes", "3", "--hidden", "4",
         "--epochs", "1", "--no-progress"]

NUMBER = ["5s", "abc", "-1", "²", "1" * 400, "1e3", "٣", "0x10", " 7 7"]
GARBAGE = {
    "count": NUMBER,                 # a whole number >= 0
    "positive": NUMBER + ["0"],      # a whole number or seconds > 0: 0 is no count, or no bound
    "seconds": NUMBER + ["nan", "inf", "1.5.2"],
    "switch": ["abc", "2", "-1", "²", "1" * 400, "yes please"],
}

# An allocation on this host that launch takes its hosts from (a dry run starts nothing).
ALLOCATION = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "1",
              "SLURM_NTASKS": "1"}
STEP = {"SLURM_STEP_ID": "0"}
TRAIN = ["train", *SMALL, "--run-dir", "run"]
LAUNCH = ["launch", "--dry-run", "--", "true"]

# Every variable the package reads: (what it holds, the entry point that reads it, what else must be set).
# "hvd" is hvd.init() in a world of one; "no number" variables are read for their presence or as text.
VARIABLES = {
    "RINGTRAIN_TIMEOUT": ("positive", "train hvd", {}),
    "RINGTRAIN_HVD_LOCAL_BYTES": ("count", "hvd", {}),
    "RINGTRAIN_ELASTIC_JOB": ("count", "hvd", {}),
    "RINGTRAIN_ELASTIC_GENERATION": ("count", "hvd", {"RINGTRAIN_ELASTIC_JOB": "1"}),
    "RINGTRAIN_CUDA_AWARE": ("switch", "info", {}),
    "HOROVOD_CYCLE_TIME": ("seconds", "hvd", {}),
    "HOROVOD_FUSION_THRESHOLD": ("count", "hvd", {}),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": ("seconds", "hvd", {}),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("seconds", "hvd", {}),
    "HOROVOD_STALL_CHECK_DISABLE": ("switch", "hvd", {}),
    "SLURM_JOB_END_TIME": ("count", "train", {}),
    "SLURM_JOB_ID": ("count", "train launch", {}),
    "SLURM_NTASKS": ("positive", "launch", ALLOCATION),
    "SLURM_NPROCS": ("positive", "launch", {k: v for k, v in ALLOCATION.items() if k != "SLURM_NTASKS"}),
    "SLURM_STEP_NUM_TASKS": ("positive", "launch", STEP),
    "WORLD_SIZE": ("count", "launch train", {}),
    "LOCAL_WORLD_SIZE": ("count", "launch train", {}),
    "RANK": ("count", "launch train", {}),
    "LOCAL_RANK": ("count", "launch train", {}),
    "PMI_RANK": ("count", "train", {}),
    "OMPI_COMM_WORLD_RANK": ("count", "train", {}),
    "PMIX_RANK": ("count", "train", {}),
    "SLURM_PROCID": ("count", "train", {}),
    "MPI_LOCALRANKID": ("count", "train", {}),
    "OMPI_COMM_WORLD_LOCAL_RANK": ("count", "train", {}),
    "SLURM_LOCALID": ("count", "train", {}),
    "PMI_SIZE": ("count", "train", {}),
    "OMPI_COMM_WORLD_SIZE": ("count", "train", {}),
    # Host lists and per-node counts: their syntax is Slurm's (tests/unit/test_slurm_variables.py).
    "SLURM_JOB_NODELIST": ("no number", "a host list", {}),
    "SLURM_NODELIST": ("no number", "a host list", {}),
    "SLURM_TASKS_PER_NODE": ("no number", "per-node counts", {}),
    "SLURM_JOB_CPUS_PER_NODE": ("no number", "per-node counts", {}),
    "SLURM_STEP_ID": ("no number", "presence: a task of a step", {}),
    "SLURM_STEPID": ("no number", "presence: a task of a step", {}),
    "PMI_FD": ("no number", "presence: Hydra's connection", {}),
    "PMI_PORT": ("no number", "presence: Hydra's connection", {}),
    "TORCHELASTIC_RUN_ID": ("no number", "presence: torchrun's mark", {}),
    "GROUP_RANK": ("no number", "presence: torchrun's mark", {}),
    "GROUP_WORLD_SIZE": ("no number", "presence: torchrun's mark", {}),
    "ROLE_WORLD_SIZE": ("no number", "presence: torchrun's mark", {}),
    "MASTER_ADDR": ("no number", "presence: torchrun's mark", {}),
    "MASTER_PORT": ("no number", "presence: torchrun's mark", {}),
    "OMP_NUM_THREADS": ("no number", "presence: the user's thread count, left alone", {}),
    "OPENBLAS_NUM_THREADS": ("no number", "presence: the user's thread count, left alone", {}),
    "MKL_NUM_THREADS": ("no number", "presence: the user's thread count, left alone", {}),
    "RINGTRAIN_ELASTIC_DIR": ("no number", "a path", {}),
    "CUPY_CACHE_DIR": ("no number", "a path", {}),
    "OMPI_ALLOW_RUN_AS_ROOT": ("no number", "set for Open MPI, not read", {}),
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": ("no number", "set for Open MPI, not read", {}),
    "HOROVOD_TIMELINE": ("no number", "a path (tests/cli/test_horovod_timeline.py)", {}),
    "HOROVOD_TIMELINE_MARK_CYCLES": ("switch", "hvd", {}),
}
# Horovod's variables the engine does not act on: read for their presence, each named in one warning line
# at hvd.init() (tests/cli/test_horovod_timeline.py).
VARIABLES.update((name, ("no number", "presence: warned about, not acted on", {})) for name in UNSERVED)
NUMBERS = {name: row for name, row in VARIABLES.items() if row[0] != "no number"}


# --- the static check ---------------------------------------------------------------------------------

FAMILY = re.compile(r"(RINGTRAIN|HOROVOD|SLURM|PMI|PMIX|OMPI|MPI|TORCHELASTIC|MASTER|WORLD|LOCAL|GROUP|ROLE|CUPY|OMP"
                    r"|OPENBLAS|MKL)_[A-Z0-9_]+")
NAMEISH = re.compile(r"[A-Z][A-Z0-9_]*")
ENV_OBJECTS = {"env", "environ", "environment"}
READERS = {"getenv", "env_int", "env_seconds", "env_flag"}


def _is_environment(node):
    return (isinstance(node, ast.Name) and node.id in ENV_OBJECTS) or (
        isinstance(node, ast.Attribute) and node.attr == "environ")


def _names_in(node):
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and NAMEISH.fullmatch(n.value)}


def _not_code(tree):
    """The ids of docstrings and of ``__all__``'s strings: names there are Python's, not the environment's."""
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                                             ast.Constant):
            skip.add(id(body[0].value))
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            skip.update(id(n) for n in ast.walk(node.value))
    return skip


def variables_read(tree):
    """Every environment variable name the module ``tree`` reads (or names as one)."""
    found, skip = set(), _not_code(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if ((name == "get" and _is_environment(getattr(func, "value", None))) or name in READERS
                    or any(_is_environment(a) for a in node.args)):
                found.update(*(_names_in(a) for a in node.args))
        elif isinstance(node, ast.Subscript) and _is_environment(node.value):
            found.update(_names_in(node.slice))
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id != "__all__" and re.search("ENV|VARIABLES|NUMBERS", t.id)
                for t in node.targets):
            found.update(_names_in(node.value))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
              and FAMILY.fullmatch(node.value)):
            found.add(node.value)
    return found


def package_variables():
    """``{variable: [modules that read it]}`` over the whole package."""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as fh:
                    for variable in variables_read(ast.parse(fh.read(), path)):
                        found.setdefault(variable, []).append(os.path.relpath(path, PACKAGE))
    return found


def test_every_variable_the_package_reads_is_in_the_table():
    found = package_variables()
    missing = {name: where for name, where in found.items() if name not in VARIABLES}
    assert not missing, f"read but not in VARIABLES (add how to exercise it): {missing}"
    stale = sorted(set(VARIABLES) - set(found))
    assert not stale, f"in VARIABLES but no longer read: {stale}"


def test_the_static_check_sees_each_way_of_reading_a_variable():
    source = ('import os\nENV_X = "A_ONE"\nTHREAD_VARIABLES = ("A_TWO",)\n__all__ = ["SLURM_NOT_READ"]\n'
              'def f(env):\n    """Reads SLURM_IN_A_DOCSTRING."""\n    env.get("A_THREE"); os.environ["A_FOUR"]\n'
              '    os.getenv("A_FIVE"); env_int(env, "A_SIX"); first(env, ("A_SEVEN", "A_EIGHT"))\n'
              '    source = "SLURM_NINE" if x else "lower"\n')
    assert variables_read(ast.parse(source)) == {"A_ONE", "A_TWO", "A_THREE", "A_FOUR", "A_FIVE", "A_SIX",
                                                 "A_SEVEN", "A_EIGHT", "SLURM_NINE"}


# --- garbage through the command line, many cases in this process --------------------------------------

def _cases(entry):
    return [(name, value) for name, (kind, entries, _) in NUMBERS.items() if entry in entries.split()
            for value in GARBAGE[kind]]


def _refused_in_process(monkeypatch, capsys, tmp_path, argv, name, value):
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    for variable, setting in {**NUMBERS[name][2], name: value}.items():
        monkeypatch.setenv(variable, setting)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    try:
        status = cli.main(list(argv))
    except SystemExit as exc:  # a world of one that a launcher's variables describe ends as the console would
        status = exc.code
    out, err = capsys.readouterr()
    lines = err.splitlines()
    shown = f"{name}={value[:20]!r}: exit {status}\n{err[-2000:]}"
    assert status == 2 and len(lines) == 1 and lines[0].startswith(f"ringtrain: error: {name}="), shown
    assert "Traceback" not in out + err and snapshot(tmp_path) == before, shown


@pytest.mark.parametrize("entry, argv", [("train", TRAIN), ("launch", LAUNCH), ("info", ["info"])])
def test_garbage_in_every_number_the_command_line_reads_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path,
                                                                               entry, argv):
    cases = _cases(entry)
    assert cases
    for name, value in cases:
        _refused_in_process(monkeypatch, capsys, tmp_path, argv, name, value)


# --- garbage through hvd.init(): one child per case, torch imported once ---------------------------------

# The variables ringtrain.torch reads at import rather than in init().
AT_IMPORT = ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "RINGTRAIN_HVD_LOCAL_BYTES")
# What must run: nothing set, WORLD_SIZE alone (no sign of torchrun), good values; the first two are
# imported afresh (the values read at import are among them).
GOOD = [{}, {"WORLD_SIZE": "4", "HOROVOD_CYCLE_TIME": "0.5", "HOROVOD_FUSION_THRESHOLD": "0",
             "RINGTRAIN_HVD_LOCAL_BYTES": "0"},
        {"RINGTRAIN_TIMEOUT": " 5 ", "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "0.5",
         "RINGTRAIN_ELASTIC_JOB": "0"},
        {"WORLD_SIZE": "4"}]


def _hvd_garbage():
    # Three values of each table (the parser's whole table is tests/unit/test_environment.py's), and the
    # issue's own: an invalid RINGTRAIN_TIMEOUT used to leave ringtrain.torch without a bound.
    cases = [(name, value) for name, (kind, entries, _) in NUMBERS.items() if "hvd" in entries.split()
             for value in GARBAGE[kind][2:5]]
    cases += [("RINGTRAIN_TIMEOUT", value) for value in ("5s", "abc", "0")]
    return sorted(cases, key=lambda case: case[0] not in AT_IMPORT)


@pytest.fixture(scope="module")
def hvd_outcomes(tmp_path_factory):
    """``(garbage cases, their results, the results of GOOD and of a torchrun case)``: one program, one torch import."""
    folder = tmp_path_factory.mktemp("hvd")
    garbage = _hvd_garbage()
    at_import = sum(name in AT_IMPORT for name, _ in garbage)
    cases = [{**NUMBERS[name][2], name: value} for name, value in garbage]
    cases = GOOD[:2] + cases[:at_import] + ["imported"] + cases[at_import:] + GOOD[2:] + [
        {"WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "none"}]
    path = folder / "cases.json"
    path.write_text(json.dumps(cases))
    env = mpirun.test_env()
    for variable in VARIABLES:
        env.pop(variable, None)
    result = run([sys.executable, HVD_PROGRAM, str(path)], timeout=400, env=env, cwd=str(folder))
    assert result.returncode == 0, show(result)
    results = json.loads(result.stdout.splitlines()[-1])
    assert os.listdir(folder) == ["cases.json"]  # nothing written
    return garbage, results[2:2 + len(garbage)], results[:2] + results[2 + len(garbage):]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (pip install torch==2.13.0)")
def test_garbage_in_every_number_hvd_init_reads_is_one_line_and_exit_2(hvd_outcomes):
    garbage, results, _ = hvd_outcomes
    for (name, value), (status, err, out) in zip(garbage, results, strict=True):
        shown = f"{name}={value[:20]!r}: exit {status}\n{err[-2000:]}"
        assert status == 2 and err.splitlines() == [err.strip()] and err.startswith(f"ringtrain: error: {name}="), \
            shown
        assert "initialised" not in out and "Traceback" not in err, shown


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (pip install torch==2.13.0)")
def test_hvd_init_with_good_values_and_a_lone_world_size_runs(hvd_outcomes):
    # WORLD_SIZE alone, with none of torchrun's own variables, is no sign of torchrun: a world of one runs.
    *good, torchrun = hvd_outcomes[2]
    assert len(good) == 4
    for status, err, out in good:
        assert status == 0 and "initialised" in out and not err.strip(), (status, err)
    status, err, out = torchrun
    assert status == 2 and err.startswith("ringtrain: error: torchrun started 4 processes (WORLD_SIZE=4)"), err


# --- samples under mpirun -np 2 ------------------------------------------------------------------------

def _assert_refused_by_the_job(result, name, tmp_path, before):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, show(result)
    assert lines and all(re.match(rf"ringtrain: error: (rank \d+: )?{name}=", line) for line in lines), show(result)
    assert len(lines) <= 2 and "Traceback" not in result.stdout + result.stderr, show(result)
    assert snapshot(tmp_path) == before, "something was written"


HVD_SCRIPT = "import ringtrain.torch as hvd\nhvd.init()\nprint('initialised', flush=True)\n"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (pip install torch==2.13.0)")
@pytest.mark.parametrize("name, value", [("RINGTRAIN_TIMEOUT", "5s"), ("HOROVOD_CYCLE_TIME", "abc")])
def test_hvd_init_under_mpirun_refuses_a_bad_value_on_every_rank(tmp_path, name, value):
    (tmp_path / "hvd.py").write_text(HVD_SCRIPT)
    before = snapshot(tmp_path)
    result = mpirun.mpirun(2, [sys.executable, "hvd.py"], timeout=120, env=mpirun.test_env(**{name: value}),
                           cwd=str(tmp_path))
    _assert_refused_by_the_job(result, name, tmp_path, before)
    assert "initialised" not in result.stdout, show(result)


# The ones read at import included: rank 1 alone used to exit at its import while rank 0 waited for ever.
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (pip install torch==2.13.0)")
@pytest.mark.parametrize("name, value, wanted", [
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "abc", "must be a number of seconds >= 0; unset it for the default"),
    ("HOROVOD_FUSION_THRESHOLD", "1e3", "must be a whole number of bytes >= 0; unset it for the default"),
    ("RINGTRAIN_HVD_LOCAL_BYTES", "-5",
     "must be a whole number of bytes from 0 to 1073741824; unset it for the default"),
    ("HOROVOD_CYCLE_TIME", "nan", "must be a number of milliseconds >= 0 and <= 10000; unset it for the default"),
])
def test_a_bad_value_on_one_rank_alone_ends_hvd_init_on_both_naming_that_rank(tmp_path, name, value, wanted):
    (tmp_path / "hvd.py").write_text(HVD_SCRIPT)
    before = snapshot(tmp_path)
    command = [find_mpirun(), "-np", "1", sys.executable, "hvd.py", ":", "-np", "1", "env",
               f"{name}={value}", sys.executable, "hvd.py"]
    result = run(command, timeout=120, env=mpirun.test_env(), cwd=str(tmp_path))
    _assert_refused_by_the_job(result, name, tmp_path, before)
    assert result.stderr.strip().splitlines() == [f"ringtrain: error: rank 1: {name}={value!r}: {wanted}"], \
        show(result)


@pytest.mark.parametrize("name, value", [("RINGTRAIN_TIMEOUT", "abc"), ("SLURM_JOB_END_TIME", "9" * 400)])
def test_train_under_mpirun_refuses_a_bad_value_in_one_line_and_writes_nothing(tmp_path, name, value):
    before = snapshot(tmp_path)
    result = mpirun.mpirun(2, mpirun.ringtrain(*TRAIN), timeout=120, env=mpirun.test_env(**{name: value}),
                           cwd=str(tmp_path))
    _assert_refused_by_the_job(result, name, tmp_path, before)
    assert len(result.stderr.strip().splitlines()) == 1, show(result)


LIBRARY_SCRIPT = (
    "import sys\nimport ringtrain\n"
    "config = ringtrain.TrainConfig(dataset='synthetic', samples=100, features=4, classes=3, hidden=(4,), epochs=1,\n"
    "                               run_dir='lib', progress=False)\n"
    "try:\n    ringtrain.train(config)\nexcept ringtrain.UsageError as exc:  # as a program's main would\n"
    "    sys.stdout.write(f'refused: {exc}\\n')  # one write: print's two may interleave with the other rank's\n"
    "    sys.stdout.flush()\n    sys.exit(2)\n")


def test_the_library_refuses_a_bad_value_on_every_rank_before_writing(tmp_path):
    # Rank 0 alone reads the job's end while training: read there only, 400 digits overflowed a float on
    # rank 0 and aborted the job; the settings agreement now refuses it on every rank.
    (tmp_path / "lib.py").write_text(LIBRARY_SCRIPT)
    before = snapshot(tmp_path)
    result = mpirun.mpirun(2, [sys.executable, "lib.py"], timeout=120,
                           env=mpirun.test_env(SLURM_JOB_END_TIME="9" * 400), cwd=str(tmp_path))
    assert result.returncode == 2, show(result)
    # One line from each rank (mpiexec may join two ranks' lines: each is counted where it begins).
    assert result.stdout.count("refused: SLURM_JOB_END_TIME=") == 2, show(result)
    assert result.stdout.lstrip().startswith("refused: ") and len(result.stdout.strip().splitlines()) <= 2, \
        show(result)
    assert "Traceback" not in result.stderr and snapshot(tmp_path) == before, show(result)


def test_a_lone_train_with_world_size_set_trains(tmp_path):
    result = run(mpirun.ringtrain(*TRAIN), timeout=120, env=mpirun.test_env(WORLD_SIZE="4"), cwd=str(tmp_path))
    assert result.returncode == 0 and "ringtrain: 1 rank(s)" in result.stdout, show(result)


def test_launch_inside_an_allocation_made_without_n_names_what_it_found(monkeypatch, capsys, tmp_path):
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    for variable, value in {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost",
                            "SLURM_JOB_CPUS_PER_NODE": "2"}.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.chdir(tmp_path)
    assert cli.main(LAUNCH) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "ringtrain: error: inside a Slurm allocation (SLURM_JOB_ID=7, SLURM_JOB_NODELIST=localhost, "
        "SLURM_JOB_CPUS_PER_NODE=2) without a task count: SLURM_NTASKS is unset, as in an allocation made without "
        "-n; give -np N (the allocation has 2 slot(s) on 1 host(s)), or allocate with -n N (sbatch/salloc -n N)"]
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert cli.main(LAUNCH) == 0, capsys.readouterr()


def test_every_variable_of_the_table_is_exercised():
    entries = {word for _, entries, _ in NUMBERS.values() for word in entries.split()}
    assert entries <= {"train", "launch", "info", "hvd"}
    assert all(GARBAGE[kind] for kind, _, _ in NUMBERS.values())
    assert subprocess.list2cmdline(LAUNCH)  # (the launch cases start nothing: --dry-run)
