"""``horovod.common``: only what Horovod's tests import."""
