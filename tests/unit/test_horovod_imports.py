"""ringtrain.horovod.imports: which ringtrain module serves each Horovod name, and the finder in one process."""

import importlib
import sys
import types

import pytest

from ringtrain.horovod import imports
from ringtrain.horovod.runner import unsupported


@pytest.fixture
def served():
    imports.install()
    try:
        yield
    finally:
        imports.uninstall()


def test_served_names():
    assert imports.served_name("horovod.torch") == "ringtrain.torch"
    assert imports.served_name("horovod.torch.mpi_ops") == "ringtrain.torch"
    assert imports.served_name("horovod.torch.elastic") == "ringtrain.torch.elastic"  # by name, when it exists
    assert imports.served_name("horovod.torch.optimizer") == "ringtrain.torch.optimizer"
    assert imports.served_name("horovod.common.exceptions") == "ringtrain.engine.errors"  # torch-free
    assert imports.served_name("horovod") == "horovod"
    assert imports.served_name("horovod.spark") is None
    assert imports.served_name("horovod.torch.elastic.sampler") == "ringtrain.torch.elastic.sampler"
    assert imports.served_name("horovod.torch.compression") == "ringtrain.torch.optimizer"
    assert imports.served_name("horovod.tensorflow") == "ringtrain.tensorflow"
    assert imports.served_name("horovod.tensorflow.mpi_ops") == "ringtrain.tensorflow.mpi_ops"
    assert imports.served_name("horovod.tensorflow.keras") == "ringtrain.keras"
    assert imports.served_name("horovod.tensorflow.keras.callbacks") == "ringtrain.keras.callbacks"
    assert imports.served_name("horovod.keras") == "ringtrain.keras"
    assert imports.served_name("horovod.keras.elastic") == "ringtrain.keras.elastic"
    assert imports.served_name("horovod.mxnet") is None


def test_horovod_common_util_helpers_are_pure():
    assert imports.is_version_greater_equal_than("2.21.0", "2.6.0")
    assert not imports.is_version_greater_equal_than("2.5.1", "2.6.0")
    assert imports.split_list(list(range(5)), 2) == [[0, 1, 2], [3, 4]]


def test_nothing_is_served_until_installed():
    assert not imports.installed()
    assert "horovod" not in sys.modules or not sys.modules["horovod"].__name__.startswith("ringtrain")


def test_the_served_modules_are_ringtrains_own(served):
    pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
    import horovod
    import horovod.torch as hvd
    import horovod.torch.compression
    import horovod.torch.mpi_ops
    from horovod.common.exceptions import HorovodInternalError
    from horovod.runner.util.threads import in_thread

    import ringtrain.torch

    assert horovod.__version__ == imports.HOROVOD_VERSION and callable(horovod.run)
    assert hvd is ringtrain.torch and horovod.torch.mpi_ops is ringtrain.torch
    assert horovod.torch.compression.Compression is ringtrain.torch.Compression
    assert hvd.__spec__.name == "ringtrain.torch"  # the alias left ringtrain's module as it was
    assert HorovodInternalError is ringtrain.torch.HorovodInternalError
    assert in_thread is imports.in_thread
    has_elastic = importlib.util.find_spec("ringtrain.torch.elastic") is not None
    if has_elastic:
        import horovod.torch.elastic

        assert horovod.torch.elastic is importlib.import_module("ringtrain.torch.elastic")
    else:
        with pytest.raises(ModuleNotFoundError, match="horovod.torch.elastic"):
            import horovod.torch.elastic  # noqa: F401


def test_an_unserved_name_says_what_is_served(served):
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'horovod.spark': python -m ringtrain.horovod "
                                                  r"serves horovod, horovod.torch"):
        import horovod.spark  # noqa: F401


def test_install_is_idempotent_and_uninstall_forgets(served):
    imports.install()
    assert sum(isinstance(f, imports.HorovodFinder) for f in sys.meta_path) == 1
    import horovod

    assert horovod.__version__ == imports.HOROVOD_VERSION
    imports.uninstall()
    assert not imports.installed() and "horovod" not in sys.modules


def test_install_refuses_beside_a_horovod_already_imported(monkeypatch):
    real = types.ModuleType("horovod")
    real.__spec__ = importlib.machinery.ModuleSpec("horovod", None)
    monkeypatch.setitem(sys.modules, "horovod", real)
    with pytest.raises(RuntimeError, match="horovod is already imported in this process"):
        imports.install()
    assert not imports.installed()


def test_in_thread_takes_a_tuple():
    with pytest.raises(ValueError, match="for one argument use"):
        imports.in_thread(print, args=1)
    seen = []
    imports.in_thread(seen.append, args=(1,)).join()
    assert seen == [1]


def test_run_refuses_what_it_does_not_serve():
    assert unsupported({"min_num_proc": None, "use_gloo": False}) is None
    assert "elastic horovod.run" in unsupported({"min_num_proc": 2})
    assert "Gloo" in unsupported({"use_gloo": True})
