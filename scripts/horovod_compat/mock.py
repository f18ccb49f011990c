"""``mock``: the standard library's unittest.mock under the old package name Horovod's test helpers import."""

from unittest.mock import *  # noqa: F401,F403
from unittest.mock import __all__  # noqa: F401
