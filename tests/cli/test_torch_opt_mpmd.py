"""Ranks whose optimizers cannot be matched, in real MPMD jobs (``mpirun -np 1 A : -np N B``).

Issue 27: ``DistributedOptimizer`` and ``broadcast_optimizer_state`` must
refuse, on every rank, with the same one line, what they cannot match (they
used to mix gradients or leave learning rates different, silently), and the
ranks must still be in step afterwards. One job per size runs every case
(tests/cli/programs/torch_opt_disagree.py); assertions come after it ends.
Skipped without torch.
"""

import json
import os
import sys

import pytest

import mpirun
from mpirun import ROOT, run, show
from ringtrain.cluster.launch import find_mpirun

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "torch_opt_disagree.py")

# case -> (the message's start, words it must hold)
REFUSED = {
    "positions": ("DistributedOptimizer: trained parameter 0 ", ["shape", "rank 0", "rank 1",
                                                               "named_parameters=model.named_parameters()"]),
    "names": ("DistributedOptimizer: parameter 'extra.weight' is trained on rank 1 but not on rank 0", []),
    "shapes": ("DistributedOptimizer: parameter 'head.weight' has shape (2, 3) on rank 0 and (5, 3) on rank 1", []),
    "reduction": ("DistributedOptimizer: op is mean on rank 0 and sum on rank 1", []),
    "groups": ("broadcast_optimizer_state: rank 1 has 2 parameter groups and the root (rank 0) has 1", []),
}


@pytest.mark.parametrize("size", [2, 3])
def test_optimizers_that_cannot_be_matched_are_refused_on_every_rank(size, tmp_path):
    command = [find_mpirun(), "-np", "1", sys.executable, PROGRAM, "a", str(tmp_path), ":",
               "-np", str(size - 1), sys.executable, PROGRAM, "b", str(tmp_path)]
    result = run(command, timeout=120, env=mpirun.test_env())
    assert result.returncode == 0, show(result)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(size)]
    for case, (start, words) in REFUSED.items():
        seen = [r[case] for r in ranks]
        assert all(s["outcome"] == "CollectiveMismatchError" and s["runtime"] and s["everywhere"] for s in seen), seen
        message = seen[0]["message"]
        assert all(s["message"] == message for s in seen), seen  # the same verdict, whichever rank found it
        assert "\n" not in message and message.startswith(start) and all(w in message for w in words), message
    # Arguments only side b's ranks refuse: each raises its own error (Horovod's type), rank 0 one naming rank 1's.
    for case, own in (("refused", "NotImplementedError"), ("unnamed", "ValueError")):
        seen = [r[case] for r in ranks]
        assert seen[0]["outcome"] == "CollectiveMismatchError" and seen[0]["everywhere"], seen
        assert all(s["outcome"] == own for s in seen[1:]), seen
        assert seen[0]["message"] == ("DistributedOptimizer: rank 1 refused its arguments: "
                                      + seen[1]["message"].removeprefix("DistributedOptimizer: ")), seen
    # Groups that match: every rank ends with the root's options.
    assert all(r["options"]["outcome"] == "ok" for r in ranks), [r["options"] for r in ranks]
    assert all(r["options"]["value"] == ranks[0]["options"]["value"] for r in ranks)
    assert all(r[case]["level"] for r in ranks for case in r), ranks
