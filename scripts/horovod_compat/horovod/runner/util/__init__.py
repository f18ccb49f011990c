"""``horovod.runner.util``: only what Horovod's tests import."""
