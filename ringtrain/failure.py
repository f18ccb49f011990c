"""How a failure on one rank ends the whole job instead of hanging it.

With mpi4py's defaults an exception on one rank ends that process while its
peers sit in the next collective forever. ringtrain closes that hole in two
ways:

* :func:`agree` turns a check made on every rank into one verdict that every
  rank acts on, so an input error found on one rank is raised on all of them
  before any training collective (no one is left waiting, nobody aborts).
* :func:`abort_on_error` is the last resort: an exception that escapes it is
  printed as ``rank R: <error>`` and the job is ended with ``MPI_Abort``, which
  makes ``mpirun`` kill every rank and exit non-zero.
"""

import contextlib
import re
import sys
import traceback

from .errors import UsageError
from .io.safeio import printable

__all__ = ["agree", "verdict_of", "abort_on_error", "describe", "GRAPH_FAILURE", "GRAPH_SLASH"]

# How a TensorFlow graph's collective fails (ringtrain.tensorflow.mpi_ops.failure_path): TensorFlow's error
# quotes a path made of this and the message, its slashes as GRAPH_SLASH (so that it stays one name), then
# "; Not a directory"; describe keeps the message alone.
GRAPH_FAILURE = "/dev/null/ringtrain: "
GRAPH_SLASH = "\u2215"  # DIVISION SLASH, which looks like one
_GRAPH_FAILURE = re.compile(re.escape(GRAPH_FAILURE) + r"(.*?); Not a directory", re.DOTALL)


# A line of a message that names an exception: "RuntimeError: ...", "errors_impl.UnknownError: ...".
_CAUSE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)(:|$)")


def describe(exc):
    """One line for an exception: ``TypeName: message`` (message only for user errors).

    A message of several lines keeps its first line and, after it, the last
    line that names an exception (else its last line): TensorFlow's graph
    errors put a header first ("Graph execution error:"), then the node and
    a traceback, and the cause (the user's ``RuntimeError``, a peer's
    failure) last but for the node markers (``[[...]]``). A TensorFlow
    graph's failed collective (:data:`GRAPH_FAILURE`) keeps its message alone.
    """
    text = _GRAPH_FAILURE.sub(lambda m: m.group(1).replace(GRAPH_SLASH, "/"), str(exc))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        rest = [line for line in lines[1:] if not line.startswith("[[")] or lines[1:]
        cause = next((line for line in reversed(rest) if _CAUSE.match(line)), rest[-1])
        text = f"{lines[0]} ... {cause}"
    if isinstance(exc, UsageError):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def agree(comm, problem):
    """Make a per-rank check into one verdict on every rank.

    Collective: every rank of ``comm`` must call it, at the same point.

    Args:
        comm: the communicator whose ranks must agree.
        problem: ``None`` when this rank found nothing wrong, else a one-line
            description of what it found.

    Raises:
        UsageError: on every rank (``everywhere=True``) if any rank reported a
            problem; the message is the lowest such rank's, naming that rank
            unless every rank reported the very same problem.
    """
    verdict = verdict_of(comm.allgather(problem))
    if verdict is not None:
        raise UsageError(verdict, everywhere=True)


def verdict_of(problems):
    """One line from every rank's problem (a list indexed by rank), or None if there are none (pure).

    The lowest rank's problem wins. It names that rank when the ranks saw
    different things, since the rank that printed may not be the one that
    found it; a problem every rank saw alike needs no rank.
    """
    for rank, found in enumerate(problems):
        if found is not None:
            same = all(p == found for p in problems)
            return found if same else f"rank {rank}: {found}"
    return None


@contextlib.contextmanager
def abort_on_error(comm=None, stream=None):
    """Abort the whole MPI job if the body raises; never leave peers waiting.

    A :class:`UsageError` raised on every rank (``everywhere=True``) or in a
    single-process job propagates, so the caller can exit with status 2. Any
    other exception is printed (traceback, then ``rank R: <error>``) and the
    job is aborted with ``MPI_Abort``: status 2 for a user error seen on one
    rank only, 1 for everything else. ``KeyboardInterrupt`` aborts too,
    because a rank that stops alone strands its peers just the same.

    Args:
        comm: communicator to abort (default ``MPI.COMM_WORLD``).
        stream: where to print (default ``sys.stderr``).
    """
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - we must catch everything to abort
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            raise
        if isinstance(exc, UsageError) and exc.everywhere:
            raise  # every rank raises it: nobody waits, so no abort (and no MPI start-up) is needed
        from mpi4py import MPI

        comm = comm if comm is not None else MPI.COMM_WORLD
        if isinstance(exc, UsageError) and (exc.everywhere or comm.Get_size() == 1):
            raise
        if isinstance(exc, SystemExit) and comm.Get_size() == 1:
            raise
        stream = stream if stream is not None else sys.stderr
        code = 2 if isinstance(exc, UsageError) else 1
        if not isinstance(exc, (UsageError, SystemExit, KeyboardInterrupt)):
            traceback.print_exception(exc, file=stream)
        stream.write(f"rank {comm.Get_rank()}: {printable(describe(exc))}\n")
        stream.flush()
        comm.Abort(code)
