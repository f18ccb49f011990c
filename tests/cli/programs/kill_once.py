"""``faulty_train.py kill`` on the first run only; a plain run after that.

Usage::

    python kill_once.py MARKER RANK STEP [ringtrain train flags...]

Rank RANK SIGKILLs itself at step STEP unless the file MARKER exists, and
creates MARKER first, so a job restarted by ``ringtrain launch --restarts``
runs clean. Only rank RANK looks at the marker: a peer that looked later
would see it already made and take a different path.
"""

import os
import sys

from ringtrain.cluster.launch import rank_from_env

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv):
    marker, rank, step, flags = argv[0], int(argv[1]), argv[2], argv[3:]
    fault = "none"
    if rank_from_env(os.environ) == rank and not os.path.exists(marker):
        open(marker, "w").close()
        fault = "kill"
    program = os.path.join(HERE, "faulty_train.py")
    os.execv(sys.executable, [sys.executable, program, fault, str(rank), step, *flags])


if __name__ == "__main__":
    main(sys.argv[1:])
