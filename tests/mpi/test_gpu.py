"""The GPU path end to end under MPI: what the CUDA IPC tests (test_cuda_ipc.py) leave out.

Runs at 1 to 4 ranks where CuPy sees a GPU (several ranks may share one);
elsewhere every test is collected and skipped with the reason. Each test
finishes its collectives before it asserts, and compares with a reference
the test computes: MPI's own Allreduce of host copies, ``allreduce_many_``,
or a CPU run.
"""

import dataclasses
import os
import tempfile

import numpy as np
import pytest
from mpi4py import MPI
from references import data, reference, same_everywhere

from ringtrain import backend
from ringtrain.cluster.topology import TaskSpec
from ringtrain.comm import Reducer, allreduce_, allreduce_many_
from ringtrain.comm.state import CommState, release
from ringtrain.comm.transports.cuda_ipc import CudaIpcTransport
from ringtrain.models.registry import build_model
from ringtrain.training.config import TrainConfig
from ringtrain.training.loop import train

try:
    import torch
except ImportError:
    torch = None

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not backend.gpu_available(), reason="no CUDA GPU visible to CuPy on this machine")]
needs_torch_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                                      reason="torch with CUDA is not installed here")


@pytest.fixture(scope="module")
def cp():
    backend.use_device(TaskSpec.from_mpi(comm).device)
    import cupy

    return cupy


@pytest.mark.mpi
def test_a_gpu_training_run_matches_the_cpu_run_and_sharded_is_bitwise_unsharded(cp):
    tmp = comm.bcast(tempfile.mkdtemp(prefix="ringtrain-gpu-") if rank == 0 else None, root=0)
    cfg = TrainConfig(dataset="synthetic", samples=400, features=40, classes=4, hidden=(48, 24), epochs=2,
                      batch_size=16, resume="none", progress=False, log_every=1000, eval_every=0)
    runs = {name: train(dataclasses.replace(cfg, run_dir=os.path.join(tmp, name), **settings), comm)
            for name, settings in [("cpu", {}), ("gpu", {"device": "gpu"}),
                                   ("gpu-unsharded", {"device": "gpu", "shard_optimizer": False})]}
    params = {name: {k: backend.to_numpy(v) for k, v in run.params.items()} for name, run in runs.items()}
    digests = comm.allgather(b"".join(p.tobytes() for p in params["gpu"].values()))
    for name in params["cpu"]:
        # Other kernels, other roundings: close to the CPU, not bitwise.
        np.testing.assert_allclose(params["gpu"][name], params["cpu"][name], rtol=2e-3, atol=2e-4, err_msg=name)
        assert np.array_equal(params["gpu"][name], params["gpu-unsharded"][name]), name
    assert len(set(digests)) == 1


@pytest.mark.mpi
@pytest.mark.parametrize("threaded", [True, False])
def test_the_overlapped_reducer_on_cupy_reduces_in_place_like_allreduce_many_(cp, threaded):
    model = build_model("mlp", 40, 4, hidden=(48, 24), xp=cp, seed=1)
    order = {n: model.grads[n] for n in reversed(model.params)}
    rng = np.random.default_rng(rank)
    x, y = cp.asarray(rng.standard_normal((6, 40)).astype(np.float32)), cp.asarray(rng.integers(0, 4, 6))
    model.loss_and_grad(x, y)
    inputs = [g.copy() for g in order.values()]
    want = allreduce_many_([g.copy() for g in inputs], "mean", comm, bucket_bytes=2048)
    with Reducer(comm, order, bucket_bytes=2048, threaded=threaded) as reducer:
        in_place = [bucket.fused is bucket.span for bucket in reducer.buckets]
        for name, g in zip(order, inputs):
            order[name][...] = g
        for name in order:
            reducer.push(name, order[name])
        reducer.wait()
        got = [cp.asnumpy(g) for g in order.values()]
    assert all(in_place) and len(in_place) > 1  # several buckets, none copied out and back
    assert all(np.array_equal(g, cp.asnumpy(w)) for g, w in zip(got, want))


@pytest.mark.mpi
@pytest.mark.parametrize("aware", ["0", "1"])
def test_hierarchical_on_cupy_reduces_within_the_host_by_cuda_ipc(cp, aware, monkeypatch):
    # With a CUDA-aware MPI this once fed CuPy arrays to the NumPy-only window and crashed.
    monkeypatch.setenv("RINGTRAIN_CUDA_AWARE", aware)
    dup = comm.Dup()  # a fresh state, which asks about CUDA-awareness anew
    host = data(100_003, np.float32, 7)
    x = cp.asarray(host)
    allreduce_(x, "sum", dup, transport="hierarchical")
    got = cp.asnumpy(x)
    made = CommState.of(dup)._transports.get(("hierarchical", backend.device_of(x)))
    inner = type(made.local).__name__ if made is not None and getattr(made, "local", None) is not None else None
    everywhere = same_everywhere(got)
    release(dup)
    np.testing.assert_allclose(got, reference(host), rtol=1e-5, atol=1e-4)
    assert everywhere and (size == 1 or inner == "CudaIpcTransport")


@pytest.mark.mpi
@pytest.mark.parametrize("nbytes", [1 << 20, 64 << 20])
def test_a_result_read_on_another_stream_is_complete(cp, nbytes):
    # The transport's last copies were once still queued on the caller's
    # stream when allreduce_ returned: fine for a reader on that stream, a
    # race for one on another non-blocking stream (or thread).
    host = data(nbytes // 4, np.float32, 9)
    mine, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with mine:
        x = cp.asarray(host)
        allreduce_(x, "sum", comm)
    with other:
        doubled = x * 2  # on another stream, at once: no event, no sync
        got = cp.asnumpy(doubled, stream=other)
        other.synchronize()
    np.testing.assert_allclose(got, 2 * reference(host), rtol=1e-5, atol=1e-3)


@pytest.mark.mpi
def test_bench_runs_each_rank_on_its_own_gpu(cp):
    from ringtrain.commands.bench import Suite

    spec = TaskSpec.from_mpi(comm)
    suite = Suite("gpu", comm)
    assert suite.gpu == spec.device == spec.local_rank % backend.device_count()
    assert cp.cuda.Device().id == suite.gpu


@pytest.mark.mpi
def test_ranks_sharing_a_gpu_find_it_in_a_shareable_compute_mode(cp):
    # EXCLUSIVE_PROCESS lets one process at a time hold a context: ranks 2..N
    # would fail at their first allocation with an unhelpful message.
    spec = TaskSpec.from_mpi(comm)
    sharing = spec.local_size > backend.device_count()
    runtime = cp.cuda.runtime
    mode = runtime.deviceGetAttribute(getattr(runtime, "cudaDevAttrComputeMode", 20), spec.device)
    assert not sharing or mode == 0, (f"GPU {spec.device} is in compute mode {mode}, not DEFAULT (0): ranks "
                                      "cannot share it; run one rank per GPU or `nvidia-smi -c DEFAULT`")


@pytest.mark.mpi
def test_ipc_handles_are_refused_for_pool_memory(cp):
    # A pool chunk's mem.ptr is not its allocation's start: the offset a peer applied would be wrong.
    with pytest.raises(ValueError, match="ipc_handle needs an array from device_buffer"):
        backend.ipc_handle(cp.empty(1000, np.float32)[10:])
    handle, offset = backend.ipc_handle(backend.device_buffer(4096)[256:])
    assert offset == 256 and isinstance(handle, bytes)


@pytest.mark.mpi
def test_cuda_ipc_set_up_failures_are_agreed_and_explained(cp):
    dup = comm.Dup()
    transport, why = CudaIpcTransport.attempt(dup)
    if transport is not None:
        transport.close()
    dup.Free()
    assert transport is not None and why is None, why


@needs_torch_cuda
@pytest.mark.mpi
@pytest.mark.parametrize("side_stream", [False, True])
def test_interop_averages_cuda_tensors_like_mpi(cp, side_stream):
    from ringtrain.torch.interop import average_gradients_, broadcast_parameters_

    device = torch.device("cuda", cp.cuda.Device().id)
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(7, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3)).to(device)
    broadcast_parameters_(model)
    stream = torch.cuda.Stream(device) if side_stream else torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        torch.manual_seed(100 + rank)
        model(torch.randn(4, 7, device=device)).square().sum().backward()
        mine = [p.grad.cpu().numpy().copy() for p in model.parameters()]
        average_gradients_(model)
        got = [p.grad.cpu().numpy() for p in model.parameters()]  # read on the side stream at once
    want = [comm.allreduce(g, op=MPI.SUM) / size for g in mine]
    everywhere = same_everywhere(np.concatenate([g.ravel() for g in got]))
    assert everywhere
    assert all(np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want))


@needs_torch_cuda
@pytest.mark.mpi
def test_a_torch_model_on_cuda_trains_through_the_sharded_step(cp):
    from ringtrain.models.base import flat_layout
    from ringtrain.optim import build_optimizer
    from ringtrain.torch.model import TorchModel
    from ringtrain.training.sharded import ShardedStep

    def made():
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
        model = TorchModel(module.to(torch.device("cuda", cp.cuda.Device().id)))
        return model, build_optimizer("sgd", model.params, lr=0.1, order=flat_layout(model).order)

    reference_model, ref_opt = made()
    model, opt = made()
    sharded = ShardedStep.create(model, opt, comm)
    for step in range(3):
        rng = np.random.default_rng(10 * step + rank)
        x, y = cp.asarray(rng.standard_normal((5, 10)).astype(np.float32)), cp.asarray(rng.integers(0, 3, 5))
        reference_model.loss_and_grad(x, y)
        allreduce_(reference_model.grad_buffer, "mean", comm, transport="shm")
        ref_opt.step(reference_model.params, reference_model.grads, 0.1)
        model.loss_and_grad(x, y)
        sharded.reduce_gradients()
        sharded.update(0.1)
        sharded.allgather()
    got, want = cp.asnumpy(model.param_buffer), cp.asnumpy(reference_model.param_buffer)
    kind = sharded.kind
    sharded.close()
    assert np.array_equal(got, want), kind
