"""The pure verdicts behind issue 27's refusals, without MPI: matching gradients and optimizer groups across ranks.

Each rank describes what it has; every rank then reaches the same verdict
from every rank's description (``match_problem`` for DistributedOptimizer,
``groups_problem`` for broadcast_optimizer_state). The multi-rank side is in
tests/cli/test_torch_opt_mpmd.py and tests/mpi/test_torch_optimizer.py.
"""

import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from ringtrain.torch.buckets import match_problem  # noqa: E402 - after the skip
from ringtrain.torch.functions import group_layout, groups_problem  # noqa: E402

PARAMS = [("body.weight", (3, 4), "torch.float32", "cpu"), ("body.bias", (3,), "torch.float32", "cpu"),
          ("head.weight", (2, 3), "torch.float32", "cpu"), ("head.bias", (2,), "torch.float32", "cpu")]


def record(params=PARAMS, reduction=("mean", None, "1.0"), refused=None):
    return {"refused": refused, "reduction": reduction, "params": list(params)}


def test_names_in_any_order_match_and_positions_do_not():
    swapped = PARAMS[2:] + PARAMS[:2]
    assert match_problem([record(), record(swapped)], [0, 1], by_name=True) is None
    problem = match_problem([record(), record(swapped)], [0, 1], by_name=False)
    assert problem.startswith("trained parameter 0 (body.weight on rank 0) has shape (3, 4) there and (2, 3) on "
                              "rank 1; pass named_parameters=model.named_parameters()")


@pytest.mark.parametrize("other, expected", [
    (PARAMS[:3], "parameter 'head.bias' is trained on rank 0 but not on rank 2"),
    (PARAMS + [("extra", (1,), "torch.float32", "cpu")], "parameter 'extra' is trained on rank 2 but not on rank 0"),
    ([PARAMS[0][:2] + ("torch.float64", "cpu")] + PARAMS[1:],
     "parameter 'body.weight' has dtype float32 on rank 0 and float64 on rank 2"),
    ([PARAMS[0][:3] + ("cuda",)] + PARAMS[1:], "parameter 'body.weight' has device cpu on rank 0 and cuda on rank 2"),
])
def test_names_that_cannot_be_matched_name_the_parameter_and_both_ranks(other, expected):
    problem = match_problem([record(), record(), record(other)], [0, 1, 2], by_name=True)
    assert problem.startswith(expected), problem
    assert "\n" not in problem


def test_the_reduction_must_agree_and_nan_equals_nan():
    nan = repr(float("nan"))
    assert match_problem([record(reduction=("sum", None, nan))] * 2, [0, 1], by_name=True) is None
    assert math.isnan(float(nan))
    problem = match_problem([record(), record(reduction=("mean", "fp16", "1.0"))], [0, 1], by_name=True)
    assert problem.startswith("compression is None on rank 0 and fp16 on rank 1")


def test_a_rank_that_refused_its_arguments_is_named_first():
    records = [record(), record(refused="op Adasum is not implemented"), record(PARAMS[:1])]
    problem = match_problem(records, [4, 5, 6], by_name=True)
    assert problem == "rank 5 refused its arguments: op Adasum is not implemented"


def _optimizer(kind="SGD", split=False, step=False):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    groups = ([{"params": net[0].parameters()}, {"params": net[1].parameters(), "lr": 0.01}] if split
              else [{"params": net.parameters()}])
    opt = getattr(torch.optim, kind)(groups, lr=0.1)
    if step:
        net(torch.ones(1, 4)).sum().backward()
        opt.step()
    return opt


def test_groups_that_match_whatever_their_options():
    layouts = [group_layout(_optimizer(step=True)), group_layout(_optimizer(step=True))]
    assert groups_problem(layouts, [0, 1], root=1) is None


@pytest.mark.parametrize("other, expected", [
    (dict(split=True), "rank 1 has 2 parameter groups and the root (rank 0) has 1"),
    (dict(kind="Adam"), "parameter group 0 has other options on rank 1 than on the root (rank 0) (amsgrad, betas"),
])
def test_groups_that_cannot_be_matched_are_named(other, expected):
    layouts = [group_layout(_optimizer(step=True)), group_layout(_optimizer(**other))]
    problem = groups_problem(layouts, [0, 1], root=0)
    assert problem.startswith(expected), problem
    assert problem.endswith("; build the optimizer with the same parameter groups on every rank")


def test_state_made_by_another_optimizer_step_is_named():
    stepped, fresh = _optimizer(kind="Adam", step=True), _optimizer(kind="Adam")
    problem = groups_problem([group_layout(stepped), group_layout(fresh)], [0, 1], root=0)
    expected = "parameter 0 of group 0 has state (none) on rank 1 and (exp_avg (3, 4) float32, "
    assert problem.startswith(expected), problem
