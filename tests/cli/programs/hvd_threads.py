"""Two threads of every rank submit unnamed allreduces, in one order on rank "a" and the other on rank "b".

Usage (MPMD, one rank each): ``python hvd_threads.py a : python hvd_threads.py b``. The main thread
reduces ones, the thread named ``worker`` hundreds. Rank a's main thread submits first; rank b's worker
does (it submits, then lets main go). Matched by the order of submission alone, each rank's first op
would pair with the other rank's other thread's (1 + 100 = 101, silently); each thread must get its own
sum: ``main 2.0``, ``worker 200.0``.
"""

import sys
import threading

import torch

import ringtrain.torch as hvd

hvd.init()
role = sys.argv[1]
submitted = threading.Event()
results = {}


def worker():
    if role == "a":
        submitted.wait()
    handle = hvd.allreduce_async(torch.full((4,), 100.0), op=hvd.Sum)
    if role == "b":
        submitted.set()
    results["worker"] = hvd.synchronize(handle)


thread = threading.Thread(target=worker, name="worker")
thread.start()
if role == "b":
    submitted.wait()
handle = hvd.allreduce_async(torch.ones(4), op=hvd.Sum)
if role == "a":
    submitted.set()
results["main"] = hvd.synchronize(handle)
thread.join(60)
for who in ("main", "worker"):
    print(f"rank {hvd.rank()}: {who} {results[who][0].item()}", flush=True)
hvd.barrier()
