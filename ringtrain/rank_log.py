"""Run a command with its stdout and stderr in ``LOGDIR/rank-R.log``.

``ringtrain launch -o LOGDIR`` puts this in front of the user's command on
every rank::

    python -m ringtrain.rank_log LOGDIR -- COMMAND...

The rank comes from the variable the MPI launcher sets; the file is opened,
made the process's stdout and stderr, and the command replaces this process
(``exec``), so its exit status and signals reach mpirun unchanged.
"""

import os
import sys

__all__ = ["rank_from_env", "main"]

# Set by MPICH's Hydra, Open MPI, PMIx launchers and Slurm's srun respectively.
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def rank_from_env(env):
    """This process's rank from the launcher's variables, or None (pure)."""
    for name in RANK_VARIABLES:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[1] == "--":
        del argv[1]
    if len(argv) < 2:
        print("usage: python -m ringtrain.rank_log LOGDIR -- COMMAND...", file=sys.stderr)
        return 2
    logdir, command = argv[0], argv[1:]
    rank = rank_from_env(os.environ)
    if rank is None:
        print("ringtrain.rank_log: no rank in the environment (" + ", ".join(RANK_VARIABLES)
              + "); run it under mpirun", file=sys.stderr)
        return 2
    # Each host makes the directory itself: without a shared file system the
    # launcher's mkdir only happened on the first host.
    os.makedirs(logdir, exist_ok=True)
    path = os.path.join(logdir, f"rank-{rank}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        # Like a shell: the reason goes to the log, 127 to mpirun.
        print(f"ringtrain.rank_log: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
