"""torch.distributed as a peer to measure against: a gloo group over an MPI communicator's ranks."""

import socket

import torch
import torch.distributed as dist


def free_port():
    """A TCP port free on this host now (rank 0 picks it; the others are told)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def gloo_allreduce(comm):
    """``contestant(x) -> fn`` running gloo's all_reduce on CuPy ``x`` in place, or None without CUDA torch.

    The group is formed over ``comm``'s ranks with rank 0's host and a free
    port broadcast over MPI, so no environment variables are needed.
    """
    if not torch.cuda.is_available():
        return None
    address = comm.bcast(socket.gethostname() if comm.Get_rank() == 0 else None, root=0)
    port = comm.bcast(free_port() if comm.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())

    def contestant(x):
        tensor = torch.from_dlpack(x)  # zero-copy: the same device memory
        return lambda: dist.all_reduce(tensor)

    return contestant
