"""A library program (no trainer) whose last rank misses a collective; the library's timeout must end it.

Usage: ``python library_stall.py ROLE [SECONDS]``. Every rank makes one
allreduce together; then a rank with ROLE ``all`` makes a second one, while
ROLE ``skip`` sleeps instead, ``raise`` raises (without abort_on_error) and
``return`` ends its program (as a rank that took another branch). Without
SECONDS the bound comes from RINGTRAIN_TIMEOUT.
"""

import sys
import time

import numpy as np

import ringtrain
import ringtrain.comm

role = sys.argv[1]
if len(sys.argv) > 2:
    ringtrain.comm.set_timeout(float(sys.argv[2]))
x = np.ones(1000, np.float32)
ringtrain.allreduce_(x)
if role == "all":
    ringtrain.allreduce_(x)
elif role == "skip":
    time.sleep(120)
elif role == "raise":
    raise RuntimeError("this rank gave up")
