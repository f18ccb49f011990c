"""``mock``: the standard library's unittest.mock under the old package name Horovod's test helpers import."""

from unittest.mock import *  # noqa: F401,F403
from unittest.mock import __all__  # noqa: F401

# The rolling backport's version of this standard library's mock (5.x follows CPython 3.11+):
# `parameterized` (Horovod's Keras tests) reads it to decide whether the bpo-40126 fix is there.
version_info = (5, 0, 0)
__version__ = "5.0.0"
