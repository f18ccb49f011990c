"""A forwarding package named ``horovod``, so Horovod's own tests run against ringtrain.torch unchanged.

Put ``scripts/horovod_compat`` first on ``PYTHONPATH`` (scripts/horovod_tests.sh
does). Nothing here is Horovod's code: each module forwards to ringtrain.
"""

__version__ = "0.28.1"
