"""Sum an array across every rank with ringtrain's allreduce; print one JSON line from rank 0.

Usage: allreduce_across_hosts.py [N [ALGORITHM]] (default ring). The reference
is MPI's own Allreduce of the same data; each rank also reports a digest of
its result, which must be the same everywhere, and, for "hierarchical", the
world ranks it talks to across hosts and whether the transport has both phases.
"""

import hashlib
import json
import socket
import sys

import numpy as np
from mpi4py import MPI

from ringtrain.comm import allreduce
from ringtrain.comm.state import state_of

comm = MPI.COMM_WORLD
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 18
x = np.random.default_rng(comm.rank).standard_normal(n)
reference = np.empty_like(x)
comm.Allreduce(x, reference, op=MPI.SUM)
algorithm = sys.argv[2] if len(sys.argv) > 2 else "ring"
result = allreduce(x, op="sum", comm=comm, transport=algorithm)
error = float(np.max(np.abs(result - reference)))
report = {"rank": comm.rank, "host": socket.gethostname(), "error": error,
          "digest": hashlib.sha256(result.tobytes()).hexdigest()}
if algorithm == "hierarchical":
    transport = state_of(comm).transport_for(algorithm, x.nbytes)
    report["two_phase"] = transport.two_phase
    if transport.two_phase:
        across = transport.across
        report["across"] = across.group.Translate_ranks(list(range(across.Get_size())), comm.group)
results = comm.gather(report, root=0)
if comm.rank == 0:
    print(json.dumps({"ranks": results, "scale": float(np.max(np.abs(reference)))}))
