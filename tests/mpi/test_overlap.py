"""The overlapping Reducer and float16 compression, against allreduce_many_ and MPI's own Allreduce.

Every test asserts after its last collective, so a failing rank cannot strand its peers.
"""

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.comm import allreduce_hook, allreduce_many_, fp16_compress_hook
from ringtrain.comm.policy import SMALL_BYTES
from ringtrain.errors import MismatchError, UsageError
from ringtrain.models.registry import build_model
from ringtrain.comm.reducer import Reducer

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
# Mixed shapes, one above the small-message threshold so a bucket takes the large-message path.
SHAPES = [(7,), (3, 5), (), (SMALL_BYTES // 4 + 3,), (4, 4), (11,)]


def grads_in_one_buffer(seed):
    """Gradients as consecutive views of one flat buffer, like a model's grad_buffer."""
    buffer = np.random.default_rng(100 * seed + rank).standard_normal(sum(int(np.prod(s)) for s in SHAPES))
    buffer = buffer.astype(np.float32)
    views, offset = {}, 0
    for i, shape in enumerate(SHAPES):
        n = int(np.prod(shape))
        views[f"g{i}"] = buffer[offset:offset + n].reshape(shape)
        offset += n
    return buffer, views


def mpi_mean(arrays):
    out = []
    for a in arrays:
        wide = a.astype(np.float64)
        comm.Allreduce(MPI.IN_PLACE, wide, MPI.SUM)
        out.append(wide / size)
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("compression", [None, "fp16"])
@pytest.mark.parametrize("threaded", [True, False])
def test_reducer_matches_allreduce_many_bitwise_and_mpi(compression, threaded):
    _, views = grads_in_one_buffer(seed=1)
    inputs = [a.copy() for a in views.values()]
    want = allreduce_many_([a.copy() for a in inputs], "mean", comm, bucket_bytes=256, compression=compression)
    reference = mpi_mean(inputs)
    results = []
    hook = allreduce_hook("mean", compression=compression)
    with Reducer(comm, views, hook, bucket_bytes=256, threaded=threaded) as reducer:
        for _ in range(2):  # a second step reuses everything
            for name, a in zip(views, inputs):
                views[name][...] = a
            for name in reversed(list(views)):  # out of order: buckets still start in order
                reducer.push(name, views[name])
            reducer.wait()
            results.append([a.copy() for a in views.values()])
        # Arbitrary arrays (not the registered views) are staged and written back.
        loose = [a.copy() for a in inputs]
        for name, a in zip(views, loose):
            reducer.push(name, a)
        reducer.wait()
    tol = 1e-6 if compression is None else 2e-3
    assert all(np.array_equal(r, w) for step in results for r, w in zip(step, want))
    assert all(np.array_equal(r, w) for r, w in zip(loose, want))
    assert all(np.allclose(w, ref, rtol=tol, atol=tol * 4) for w, ref in zip(want, reference))


@pytest.mark.mpi
def test_reducer_as_a_model_on_grad_hook():
    model = build_model("mlp", 6, 3, hidden=(8, 5), seed=0)
    rng = np.random.default_rng(rank)
    x, y = rng.standard_normal((16, 6)).astype(np.float32), rng.integers(0, 3, 16)
    _, grads, _ = model.loss_and_grad(x, y)
    want = allreduce_many_([grads[n].copy() for n in reversed(model.params)], "mean", comm, bucket_bytes=200)
    order = {n: model.grads[n] for n in reversed(model.params)}
    with Reducer(comm, order, bucket_bytes=200) as reducer:
        in_place = all(b.span is not None for b in reducer.buckets)
        model.loss_and_grad(x, y, on_grad=reducer.push)
        reducer.wait()
    got = [model.grads[n] for n in reversed(model.params)]
    assert in_place
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.mpi
def test_fp16_compression_of_a_large_mean_does_not_overflow():
    x = np.full(1000, 60000.0, np.float32) + rank  # each value near float16's maximum
    want = mpi_mean([x])[0]
    allreduce_many_([x], "mean", comm, compression="fp16")
    assert np.allclose(x, want, rtol=2e-3)


@pytest.mark.mpi
def test_unknown_compression_is_an_error_everywhere():
    with pytest.raises(UsageError, match="unknown compression 'int8'"):
        allreduce_many_([np.ones(3)], "mean", comm, compression="int8")
    with pytest.raises(UsageError, match="unknown compression 'int8'"):
        Reducer(comm, [np.ones(3)], hook=allreduce_hook(compression="int8"))


@pytest.mark.mpi(min_size=2)
def test_mismatched_buckets_raise_in_wait_on_every_rank():
    grads = [np.ones(5 if rank else 4, np.float32), np.ones(3, np.float32)]
    with Reducer(comm, grads, bucket_bytes=16) as reducer:
        reducer.push(0, grads[0])
        reducer.push(1, grads[1])
        with pytest.raises(MismatchError) as info:
            reducer.wait()
        # Still in step afterwards.
        ones = [np.ones(2), np.ones(3)]
        reducer2 = Reducer(comm, ones)
        reducer2.wait()
        reducer2.close()
    assert "Reducer" in str(info.value)
    assert all(np.array_equal(a, np.ones_like(a)) for a in ones)


@pytest.mark.mpi
def test_one_hook_serves_two_reducers_and_custom_hooks_decide_how():
    # A hook is a plain function: the same float16 hook for two reducers of
    # different buckets, and a hook of our own that sums in place of the mean.
    hook = fp16_compress_hook()
    a = [np.full(300, rank + 1.0, np.float32), np.full(7, rank + 1.0, np.float32)]
    b = [np.full(50, rank + 1.0, np.float32)]
    calls = []

    def summed(state, bucket):
        calls.append(bucket.index)
        allreduce_hook("sum")(state, bucket)

    c = [np.full(9, rank + 1.0)]
    with Reducer(comm, a, hook, bucket_bytes=64) as first, Reducer(comm, b, hook) as second, \
            Reducer(comm, c, summed) as third:
        for reducer in (first, second, third, first):
            reducer.wait()
    mean, total = (size + 1) / 2, size * (size + 1) / 2
    assert all(np.array_equal(x, np.full_like(x, mean)) for x in a + b)  # a reduced twice: the mean stays
    assert np.array_equal(c[0], np.full(9, total)) and calls == [0]
