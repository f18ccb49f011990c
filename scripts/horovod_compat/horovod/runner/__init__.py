"""``horovod.runner``: only what Horovod's tests import."""
