"""ringtrain.torch.tensors: the views the engine is handed, and which CUDA stream is synced before it reads them."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from ringtrain.engine.arrays import bf16_to_f32, f32_to_bf16  # noqa: E402 - after the importorskip above
from ringtrain.torch import tensors  # noqa: E402


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
