"""``python -m ringtrain.horovod SCRIPT``: an unmodified Horovod script, run under real mpirun and through horovod.run.

The script (tests/cli/programs/horovod_script.py) uses pytorch_mnist.py's
Horovod lines verbatim. Its trained weights are compared with a straight run
computed here (one process, the ranks' gradients averaged by hand), and a
real ``horovod`` installed in the environment (a stand-in package in a temp
site folder) must stay what every other process imports. Skipped without torch.
"""

import importlib.util
import json
import os
import sys

import pytest

import mpirun
from mpirun import ROOT, run, show
from ringtrain.cluster.launch import find_mpirun

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "horovod_script.py")
RUNNER = [sys.executable, "-m", "ringtrain.horovod"]


def _program():
    """The script as a module (its ``__main__`` block not run), imported with horovod served from ringtrain."""
    from ringtrain.horovod import install, uninstall

    install()
    try:
        spec = importlib.util.spec_from_file_location("horovod_script", PROGRAM)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        uninstall()


def _straight_run(size, seed=42, lr=0.1):
    """The weights one process reaches with the ranks' gradients averaged by hand."""
    program = _program()
    torch.manual_seed(seed)  # rank 0's start, which broadcast_parameters gives every rank
    model = torch.nn.Linear(program.FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    start = [p.detach().clone() for p in model.parameters()]
    shards = [program.rows_of(rank) for rank in range(size)]
    for _ in range(program.STEPS):
        grads = []
        for x, y in shards:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = torch.stack(per_rank).mean(0)
        optimizer.step()
    return start, [p.detach() for p in model.parameters()]


def _check(results, size, argv):
    assert [r["rank"] for r in results] == list(range(size))
    assert all(r["argv"] == argv for r in results)  # every rank sees the command line the script was given
    start, end = _straight_run(size)
    for r in results:
        assert r["size"] == size and r["hvd"] == "ringtrain.torch" and r["version"] == "0.28.1"
        assert r["mean_rank"] == pytest.approx(sum(range(size)) / size)
        for got, want in zip(r["start"], start):
            torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=0)
        for got, want in zip(r["end"], end):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def _lines(stdout, word):
    return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith(word + " ")]


def test_horovod_run_starts_the_ranks_and_returns_their_results_in_rank_order():
    result = run(RUNNER + [PROGRAM, "--num-proc", "3"], timeout=240, env=mpirun.test_env())
    assert result.returncode == 0, show(result)
    (results,) = _lines(result.stdout, "results")
    _check(results, 3, ["--num-proc", "3"])


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_script_under_mpirun_matches_a_straight_run(size):
    result = run([find_mpirun(), "-np", str(size)] + RUNNER + [PROGRAM], timeout=240, env=mpirun.test_env())
    assert result.returncode == 0, show(result)
    (results,) = _lines(result.stdout, "results")
    _check(results, size, [])


def test_a_rank_that_raises_in_horovod_run_fails_the_call_and_names_the_rank():
    result = run(RUNNER + [PROGRAM, "--num-proc", "2", "--fail-on-rank", "1"], timeout=240, env=mpirun.test_env())
    assert result.returncode == 1, show(result)
    # The rank's own lines may be cut short when MPI_Abort ends the job: the driver's error quotes its line.
    assert ("RuntimeError: horovod.run: the job on 2 ranks failed: mpirun exited with status 1: rank 1: "
            "horovod.run's function failed: ValueError: rank 1 fails on purpose") in result.stderr, show(result)
    assert "results" not in result.stdout


def test_a_rank_that_raises_under_mpirun_ends_the_job_instead_of_stranding_its_peers():
    # Rank 0 waits in broadcast_parameters: the job must end (the runner aborts it), not hang.
    result = run([find_mpirun(), "-np", "2"] + RUNNER + [PROGRAM, "--fail-on-rank", "1"], timeout=120,
                 env=mpirun.test_env())
    assert result.returncode not in (0, 2), show(result)
    assert "ValueError: rank 1 fails on purpose" in result.stderr, show(result)


def test_an_installed_horovod_is_not_shadowed_outside_the_runner(tmp_path):
    site = tmp_path / "site"
    (site / "horovod" / "torch").mkdir(parents=True)
    (site / "horovod" / "__init__.py").write_text("__version__ = 'the real one'\n")
    (site / "horovod" / "torch" / "__init__.py").write_text("WHO = 'the real horovod.torch'\n")
    (site / "horovod-0.28.1.dist-info").mkdir()
    (site / "horovod-0.28.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: horovod\n"
                                                               "Version: 0.28.1\n")
    env = mpirun.test_env(PYTHONPATH=os.pathsep.join([str(site), ROOT]))
    probe = ("import ringtrain, ringtrain.horovod, ringtrain.torch, horovod, horovod.torch; "
             "print(horovod.__version__, '|', horovod.torch.WHO)")
    outside = run([sys.executable, "-c", probe], timeout=120, env=env)
    assert outside.returncode == 0, show(outside)
    assert outside.stdout.strip() == "the real one | the real horovod.torch", show(outside)
    script = tmp_path / "probe.py"
    script.write_text("import horovod, horovod.torch\nprint(horovod.__version__, '|', horovod.torch.__name__)\n")
    inside = run(RUNNER + [str(script)], timeout=120, env=env)
    assert inside.returncode == 0, show(inside)
    assert inside.stdout.strip() == "0.28.1 | ringtrain.torch", show(inside)


def test_bad_runner_usage_is_one_line_and_exit_2(tmp_path):
    for argv in ([], [str(tmp_path / "missing.py")], ["-m"]):
        result = run(RUNNER + argv, timeout=60, env=mpirun.test_env())
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
