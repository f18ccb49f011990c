"""``ringtrain info``: every rank's place in the job, printed once by rank 0."""

import dataclasses

from ..cluster.topology import TaskSpec

HELP = "show every rank's host, local rank, node and device, the MPI library, and whether it is CUDA-aware"


def add_arguments(parser):
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def device_name(spec):
    """What the rank computes on, as the table and the JSON both say it: ``cpu`` or ``gpu N`` (pure)."""
    return "cpu" if spec.device is None else f"gpu {spec.device}"


def rank_record(spec):
    """One rank's JSON object: its TaskSpec's fields, ``device`` as the table says it, ``gpu`` its index or None."""
    record = {k: v for k, v in dataclasses.asdict(spec).items() if k != "hosts"}
    record["device"], record["gpu"] = device_name(spec), spec.device
    return record


def table(specs):
    """Format a list of TaskSpecs (indexed by rank) as a fixed-width table."""
    header = ("rank", "host", "local", "node", "device")
    rows = [
        (str(s.rank), s.hostname, f"{s.local_rank}/{s.local_size}", f"{s.node_rank}/{s.num_nodes}", device_name(s))
        for s in specs
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [header, *rows])


def run(args):
    import json

    from mpi4py import MPI

    from ..comm.cuda_aware import cuda_aware

    comm = MPI.COMM_WORLD
    aware, why = cuda_aware()
    spec = TaskSpec.from_mpi(comm)
    ipc = _cuda_ipc(comm, spec)
    specs = comm.gather(spec, root=0)
    if not spec.is_master:
        return 0
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    if args.json:
        print(json.dumps({
            "mpi_library": library,
            "mpi_version": "%d.%d" % MPI.Get_version(),
            "size": spec.size,
            "num_nodes": spec.num_nodes,
            "cuda_aware": aware,
            "cuda_aware_why": why,
            "cuda_ipc": ipc,
            "ranks": [rank_record(s) for s in specs],
        }, indent=2))
        return 0
    print(f"ringtrain: {spec.size} rank(s) on {spec.num_nodes} node(s); MPI: {library}")
    print(f"CUDA-aware MPI: {'yes' if aware else 'no'} ({why})")
    if ipc is not None:
        print(f"CUDA IPC among these ranks: {ipc}")
    print(table(specs))
    return 0


def _cuda_ipc(comm, spec):
    """"yes", or why CUDA IPC cannot serve ``comm``; None where a rank has no GPU (collective).

    Where it fails, GPU allreduces fall to host speed: this is where a user
    learns why (a container without a shared IPC namespace, MIG, no peer access).
    """
    from mpi4py import MPI

    from ..comm.transports.cuda_ipc import CudaIpcTransport

    if not comm.allreduce(int(spec.device is not None), op=MPI.MIN):
        return None
    if comm.Get_size() == 1:
        return "yes (one rank: nothing to map)"
    # Each rank on the GPU a run would give it: on a host with several GPUs,
    # mapping across them (peer access) is what a run needs, and what may fail.
    from .. import backend

    backend.use_device(spec.device)
    dup = comm.Dup()
    transport, why = CudaIpcTransport.attempt(dup)
    if transport is not None:
        transport.close()
    dup.Free()
    return "yes" if transport is not None else why or "no: the ranks are on several hosts"

