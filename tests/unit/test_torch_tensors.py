"""ringtrain.torch.tensors: the views the engine is handed, and which CUDA stream is synced before it reads them."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from ringtrain.engine import kernels  # noqa: E402 - after the importorskip above
from ringtrain.engine.arrays import bf16_to_f32, f32_to_bf16  # noqa: E402
from ringtrain.engine.negotiation import Allreduce  # noqa: E402
from ringtrain.torch import tensors  # noqa: E402
from ringtrain.torch.tensors import array_of, check_tensor, dtype_name, tensor_of  # noqa: E402


class _FakeCuda:
    """A CUDA tensor's face, enough for the sync: its device, and is_cuda."""

    is_cuda = True

    def __init__(self, index):
        self.device = torch.device("cuda", index)


def test_the_stream_synced_is_the_current_one_of_the_tensors_own_device_not_of_the_current_device(monkeypatch):
    asked, synced = [], []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            synced.append(self.device)

    def current_stream(device=None):
        asked.append(device)
        return Stream(device)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0, raising=False)
    on_one, also_on_one, on_zero = _FakeCuda(1), _FakeCuda(1), _FakeCuda(0)
    assert tensors.stream_of(on_one).device == torch.device("cuda", 1)
    tensors.sync([torch.ones(2), on_one, also_on_one, on_zero])
    # Once per device, each tensor's own, and never the current device's stream (current_stream()).
    assert synced == [torch.device("cuda", 1), torch.device("cuda", 0)] and None not in asked


def test_views_share_the_tensors_memory_and_bfloat16_travels_as_its_bits():
    t = torch.arange(6, dtype=torch.float32)
    array, dtype = tensors.engine_view(t)
    array[0] = 42.0
    assert dtype is None and t[0].item() == 42.0
    b = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    bits, dtype = tensors.engine_view(b)
    assert dtype == "bfloat16" and bits.dtype == np.int16
    np.testing.assert_array_equal(bf16_to_f32(bits.view(np.uint16)), [1.5, -2.25, 3.0])
    back = tensors.tensor_of(f32_to_bf16(np.array([0.1, 1e30, -7.0], np.float32)), "bfloat16")
    # Rounded to nearest even as torch rounds float32 to bfloat16.
    assert torch.equal(back, torch.tensor([0.1, 1e30, -7.0]).to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_cuda_tensor_on_a_device_that_is_not_current_is_synced_and_viewed_on_its_own_device():
    torch.cuda.set_device(0)
    t = torch.zeros(1 << 20, device="cuda:1")
    t.add_(1.0)  # queued on device 1's stream
    array, _ = tensors.engine_view(t)
    assert array.device.id == 1 and float(array.sum()) == float(1 << 20)


def test_tensors_no_collective_takes_are_named_in_one_line():
    assert check_tensor(torch.ones(2), "allreduce") is None
    assert "expected a torch.Tensor, got list" in check_tensor([1.0], "allreduce")
    assert "complex64 is not supported" in check_tensor(torch.ones(2, dtype=torch.complex64), "allreduce")
    assert "sparse tensor" in check_tensor(torch.ones(2).to_sparse(), "allreduce")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                                   torch.int8, torch.uint8, torch.bool])
@pytest.mark.parametrize("op", ["sum", "average", "min", "max", "product"])
def test_a_small_op_computed_on_the_spot_matches_a_reference_reduction(dtype, op):
    rng = np.random.default_rng(3)
    values = [rng.integers(0 if dtype in (torch.uint8, torch.bool) else -3, 4, size=5) for _ in range(3)]
    inputs = [torch.tensor(v).to(dtype) for v in values]
    meta = Allreduce(dtype_name(dtype), (5,), op, 1.0, 1.0, "cpu")
    out, element = array_of(torch.empty(5, dtype=dtype))
    views = [array_of(t)[0] for t in inputs]
    # Rank 1's input arrives as raw bytes, as it would from another rank.
    got = kernels.reduce_locally(meta, [views[0], kernels.raw_bytes(views[1]), views[2]], out)
    assert got is out
    got = tensor_of(got, element)
    stacked = np.stack([v.astype(np.float64) for v in values])
    if dtype == torch.bool:
        want = stacked.any(0) if op in ("sum", "average", "max") else stacked.all(0)
    else:
        want = {"sum": stacked.sum(0), "min": stacked.min(0), "max": stacked.max(0), "product": stacked.prod(0),
                "average": stacked.sum(0) / 3}[op]
        if op == "average" and not dtype.is_floating_point:
            want = np.trunc(want)  # integers are averaged in float64 and truncated, as Horovod does
        if op == "average" and dtype in (torch.float32, torch.float64):
            kind = np.float32 if dtype == torch.float32 else np.float64
            want = stacked.sum(0).astype(kind) / kind(3)  # the sum, then one division in the dtype
    # Half precision sums, then multiplies by 1/3 (as Horovod): equal to about its precision.
    half = dtype in (torch.float16, torch.bfloat16) and op == "average"
    np.testing.assert_allclose(got.to(torch.float64).numpy(), want, rtol=1e-2 if half else 0)
