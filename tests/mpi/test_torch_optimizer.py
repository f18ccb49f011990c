"""ringtrain.torch's DistributedOptimizer, helpers and SyncBatchNorm against one process on the full batch.

Every rank draws the same global batch from one seed and trains on its own
rows; the reference is one process (each rank computes it alone, with plain
torch) training on all the rows. Collectives come first, assertions last, so
a failing rank cannot strand its peers. Skipped where torch is not installed.
"""

import pickle
import warnings

import numpy as np
import pytest
from mpi4py import MPI

try:
    import torch
    import torch.nn.functional as F

    import ringtrain.torch as hvd
except ImportError:  # collected and skipped, so the suite still sees this file's tests
    torch = None

pytestmark = pytest.mark.skipif(torch is None, reason="torch is not installed")

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
ROWS = 4  # per rank and backward pass


def setup_module():
    hvd.init()


def _net(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def _batch(step, rows, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 6, generator=g, dtype=dtype), torch.randn(rows, 3, generator=g, dtype=dtype)


def _mine(x):
    """This rank's rows of a global batch."""
    per = len(x) // size
    return x[rank * per:(rank + 1) * per]


def _close(model, reference, tol):
    pairs = zip(model.parameters(), reference.parameters())
    return max(float((a - b).detach().abs().max()) for a, b in pairs) <= tol


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("how", ["average", "sum", "predivide", "fp16", "many-buckets"])
def test_distributed_optimizer_equals_one_process_on_the_full_batch(name, how, monkeypatch):
    if how == "many-buckets":  # a bucket per gradient, reduced on the communication thread during backward
        monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1")
    dtype = torch.float32 if how == "fp16" else torch.float64
    model, reference = _net(dtype), _net(dtype)
    kwargs = {"sum": {"op": hvd.Sum}, "predivide": {"gradient_predivide_factor": 2.0},
              "fp16": {"compression": hvd.Compression.fp16}}.get(how, {})
    opt = hvd.DistributedOptimizer(OPTIMIZERS[name](model.parameters()), named_parameters=model.named_parameters(),
                                   **kwargs)
    ref_opt = OPTIMIZERS[name](reference.parameters())
    for step in range(4):
        x, y = _batch(step, ROWS * size, dtype)
        opt.zero_grad()
        F.mse_loss(model(_mine(x)), _mine(y)).backward()
        opt.step()
        ref_opt.zero_grad()
        # Sum adds every rank's mean: the full batch's mean times the number of ranks.
        (F.mse_loss(reference(x), y) * (size if how == "sum" else 1)).backward()
        ref_opt.step()
    same = comm.allgather(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    assert isinstance(opt, type(ref_opt)) and type(opt).__name__ == type(ref_opt).__name__
    assert _close(model, reference, 1e-2 if how == "fp16" else 1e-5)
    assert all(s == same[0] for s in same)


@pytest.mark.mpi
def test_ranks_that_differ_in_which_parameters_get_gradients():
    # Two heads; rank r trains through head r % 2 only, so the other head has no gradient there.
    def build():
        torch.manual_seed(1)
        return torch.nn.ModuleDict({"body": torch.nn.Linear(6, 8), "a": torch.nn.Linear(8, 3),
                                    "b": torch.nn.Linear(8, 3)}).double()

    def loss(net, x, y, r):
        return F.mse_loss(net["ab"[r % 2]](torch.tanh(net["body"](x))), y)

    model, reference = build(), build()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _batch(step, ROWS * size, torch.float64)
        opt.zero_grad()
        loss(model, _mine(x), _mine(y), rank).backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(loss(reference, x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS], r)
             for r in range(size)) / size).backward()
        ref_opt.step()
    assert _close(model, reference, 1e-9)


@pytest.mark.mpi
@pytest.mark.parametrize("k", [2, 3])
def test_backward_passes_per_step_equals_one_step_on_k_times_the_batch(k):
    model, reference = _net(torch.float64), _net(torch.float64)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=k)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    refused = []
    for step in range(3):
        x, y = _batch(step, ROWS * size * k, torch.float64)
        opt.zero_grad()
        for i in range(k):  # pass i takes rows [i, i+1) of every rank's k-row share
            part = x.view(size, k, ROWS, 6)[rank, i], y.view(size, k, ROWS, 3)[rank, i]
            (F.mse_loss(model(part[0]), part[1]) / k).backward()
            if i == 0 and size > 1:
                try:
                    opt.zero_grad()  # between backward and step: refused, as Horovod does
                except AssertionError as exc:
                    refused.append(str(exc))
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    assert _close(model, reference, 1e-9)
    assert len(refused) == (3 if size > 1 else 0)
    assert all(r.startswith("optimizer.zero_grad() was called after loss.backward()") for r in refused)


@pytest.mark.mpi
def test_synchronize_clip_and_skip_synchronize():
    model, reference = _net(torch.float64), _net(torch.float64)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    x, y = _batch(0, ROWS * size, torch.float64)
    opt.zero_grad()
    F.mse_loss(model(_mine(x)), _mine(y)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    F.mse_loss(model(_mine(x)), _mine(y)).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # after synchronize(), without skip_synchronize: Horovod's warning
    for clip in (True, False):
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        ref_opt.step()
    assert _close(model, reference, 1e-9)
    assert [str(w.message) for w in caught if "skip_synchronize" in str(w.message)]


@pytest.mark.mpi
def test_argument_errors_are_horovods():
    net1, net2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(list(net1.parameters()) + list(net2.parameters()), lr=0.1)
    errors = []
    for kwargs in ({"named_parameters": list(net1.named_parameters()) + list(net2.named_parameters())},
                   {"named_parameters": list(net1.named_parameters())},
                   {"named_parameters": [p for p in net1.parameters()]},
                   {"backward_passes_per_step": 0},
                   {"op": hvd.Sum, "gradient_predivide_factor": 2.0}):
        try:
            hvd.DistributedOptimizer(opt, **kwargs)
        except ValueError as exc:
            errors.append(str(exc))
    unnamed = hvd.DistributedOptimizer(torch.optim.SGD(net1.parameters(), lr=0.1))
    assert len(errors) == 5, errors
    assert "duplicates: bias, weight" in errors[0] and "not named" in errors[1]
    assert sorted(unnamed._parameter_names.values()) == ["allreduce.noname.0.0", "allreduce.noname.0.1"]


@pytest.mark.mpi(min_size=2)
def test_too_many_backward_passes_is_refused():
    model = _net(torch.float64)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = _batch(0, ROWS, torch.float64)
    F.mse_loss(model(x), y).backward()
    try:
        F.mse_loss(model(x), y).backward()
        message = None
    except AssertionError as exc:
        message = str(exc)
    opt.step()  # collective: the first pass's reduction still ends on every rank
    assert message is not None and "more than backward_passes_per_step" in message


@pytest.mark.mpi(min_size=2)
def test_an_op_ringtrain_does_not_reduce_is_named():
    model = _net(torch.float64)
    messages = {}
    for op in (hvd.Adasum, hvd.Product, 7):
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), op=op)
        except (NotImplementedError, ValueError) as exc:
            messages[op] = f"{type(exc).__name__}: {exc}"
    assert messages[hvd.Adasum].startswith("NotImplementedError: DistributedOptimizer: op=hvd.Adasum is not "
                                           "implemented by ringtrain on more than one rank; use hvd.Average"), messages
    assert "op=hvd.Product is not implemented" in messages[hvd.Product], messages
    assert messages[7].startswith("ValueError: unknown reduction op 7; choose one of average (0)"), messages


STATEFUL = ["ASGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD"]


@pytest.mark.mpi
@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("name", STATEFUL)
def test_broadcast_optimizer_state_gives_every_rank_the_roots(name, wrapped):
    model = _net(torch.float32, seed=rank)
    options = {"lr": 0.01 * (rank + 1)}
    if name == "SGD":
        options["momentum"] = 0.5 + 0.1 * rank
    opt = getattr(torch.optim, name)(model.parameters(), **options)
    if rank == 0:  # only the root has state; the others never stepped
        x, y = _batch(0, ROWS, torch.float32)
        F.mse_loss(model(x), y).backward()
        opt.step()
    if wrapped:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    roots = comm.bcast(pickle.dumps(opt.state_dict()) if rank == 0 else None, root=0)  # MPI's own broadcast
    mine, theirs = opt.state_dict(), pickle.loads(roots)
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for pid, state in theirs["state"].items():
        for key, value in state.items():
            got = mine["state"][pid][key]
            assert type(got) is type(value) and (torch.equal(got, value) if torch.is_tensor(value) else got == value)
    # Making the state on a fresh rank takes a step on zero gradients, which must move no weight.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.mpi
@pytest.mark.parametrize("dims", [2, 4])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batch_norm_equals_batch_norm_on_the_full_batch(dims, momentum):
    shape = (ROWS * size, 3) + (5, 4)[: dims - 2]
    g = torch.Generator().manual_seed(7)
    x, upstream = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1, torch.randn(shape, generator=g,
                                                                                            dtype=torch.float64)
    plain = (torch.nn.BatchNorm1d if dims == 2 else torch.nn.BatchNorm2d)(3, momentum=momentum).double()
    synced = hvd.SyncBatchNorm(3, momentum=momentum).double()
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5, generator=g)
        plain.bias.uniform_(-1, 1, generator=g)
    synced.load_state_dict(plain.state_dict())
    xs = [x.clone().requires_grad_(), _mine(x).clone().requires_grad_()]
    for _ in range(2):  # two steps, so the running statistics are averaged too
        for net, inp, up in ((plain, xs[0], upstream), (synced, xs[1], _mine(upstream))):
            inp.grad = None
            net.zero_grad()
            outputs = net(inp)
            (outputs * up).sum().backward()
            if net is synced:
                out = outputs
    weight_grad = synced.weight.grad.clone()
    comm.Allreduce(MPI.IN_PLACE, weight_grad.numpy())  # every rank's share of the full batch's gradient
    full = F.batch_norm(x, None, None, plain.weight, plain.bias, training=True)  # no running statistics touched
    plain.eval(), synced.eval()
    assert torch.allclose(out, _mine(full), atol=1e-9)
    assert torch.allclose(xs[1].grad, _mine(xs[0].grad), atol=1e-9)
    assert torch.allclose(weight_grad, plain.weight.grad, atol=1e-9)
    assert torch.allclose(synced.running_mean, plain.running_mean, atol=1e-12)
    assert torch.allclose(synced.running_var, plain.running_var, atol=1e-12)
    assert torch.allclose(synced(_mine(x)), _mine(plain(x)), atol=1e-12)  # eval: the running statistics


@pytest.mark.mpi
def test_broadcast_parameters_takes_every_dtype():
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.complex64]
    root = size - 1
    state = {f"t{i}": (torch.arange(5 + i) + rank).to(dt) for i, dt in enumerate(dtypes)}
    state["scalar"] = torch.tensor(float(rank))
    named = [("w", torch.full((2, 3), float(rank), requires_grad=True))]
    hvd.broadcast_parameters(state, root_rank=root)
    hvd.broadcast_parameters(named, root_rank=root)
    expected = comm.bcast({k: v.clone() for k, v in state.items()} if rank == root else None, root=root)
    assert all(torch.equal(state[k], expected[k]) and state[k].dtype == expected[k].dtype for k in expected)
    assert torch.equal(named[0][1].detach(), torch.full((2, 3), float(root)))


@pytest.mark.mpi
def test_objects_match_mpis_own():
    obj = {"rank": rank, "payload": list(range(rank * 50))}
    got_b = hvd.broadcast_object(obj, root_rank=size - 1)
    got_a = hvd.allgather_object(obj)
    assert got_b == comm.bcast(obj, root=size - 1)
    assert got_a == comm.allgather(obj)
    assert np.all([isinstance(o, dict) for o in got_a])


@pytest.mark.mpi(min_size=2)
def test_a_process_set_reduces_within_itself():
    # Even and odd ranks each average among themselves; the reference is one process on the set's rows.
    sets = [hvd.add_process_set([r for r in range(size) if r % 2 == parity]) for parity in (0, 1)]
    mine = sets[rank % 2]
    members = list(mine.ranks)
    model, reference = _net(torch.float64), _net(torch.float64)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=mine)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _batch(0, ROWS * size, torch.float64)
    opt.zero_grad()
    F.mse_loss(model(_mine(x)), _mine(y)).backward()
    opt.step()
    rows = torch.cat([torch.arange(r * ROWS, (r + 1) * ROWS) for r in members])
    ref_opt.zero_grad()
    F.mse_loss(reference(x[rows]), y[rows]).backward()
    ref_opt.step()
    got = hvd.broadcast_object({"from": rank}, root_rank=members[-1], process_set=mine)
    for ps in reversed(sets):
        hvd.remove_process_set(ps)
    assert _close(model, reference, 1e-9)
    assert got == {"from": members[-1]}


@pytest.mark.mpi(min_size=2)
def test_helpers_take_the_jobs_root_rank_in_a_process_set():
    # A set without rank 0 whose root is the job's last rank: its own rank is len(members) - 1, never the
    # job's. Passed on untranslated, the root is outside the set's communicator and its ranks hang.
    members = list(range(1, size))
    ps = hvd.add_process_set(members)
    sub = comm.Split(0 if rank in members else MPI.UNDEFINED, rank)
    root = members[-1]
    got, expected, state_ok, params_ok, failure = None, None, True, True, None
    if rank in members:
        try:
            got, expected, params_ok, state_ok = _set_helpers(ps, sub, root)
        except Exception as exc:  # raised after the barrier, so rank 0 is not left waiting
            failure = exc
        sub.Free()
    comm.Barrier()
    hvd.remove_process_set(ps)
    if failure is not None:
        raise failure
    assert got == expected
    assert params_ok and state_ok


def _set_helpers(ps, sub, root):
    """broadcast_object, broadcast_parameters, broadcast_optimizer_state in ``ps`` against MPI on ``sub``."""
    got = hvd.broadcast_object({"from": rank, "pad": list(range(rank * 30))}, root_rank=root, process_set=ps)
    expected = sub.bcast({"from": rank, "pad": list(range(rank * 30))}, root=sub.Get_size() - 1)
    model = _net(torch.float64, seed=rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root, process_set=ps)
    want = sub.bcast([p.detach().clone() for p in model.parameters()] if rank == root else None,
                     root=sub.Get_size() - 1)
    params_ok = all(torch.equal(a.detach(), b) for a, b in zip(model.parameters(), want))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == root:  # only the root has state; the others get it, and its lr
        model(torch.ones(1, 6, dtype=torch.float64)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=root, process_set=ps)
    mine = (opt.param_groups[0]["lr"], [s["exp_avg"].clone() for s in opt.state.values()])
    theirs = sub.bcast(mine if rank == root else None, root=sub.Get_size() - 1)
    state_ok = mine[0] == theirs[0] and all(torch.equal(a, b) for a, b in zip(mine[1], theirs[1]))
    return got, expected, params_ok, state_ok


@pytest.mark.mpi(min_size=2)
def test_a_root_outside_the_process_set_is_refused_on_every_rank():
    members = list(range(1, size))
    ps = hvd.add_process_set(members)
    errors = []
    if rank in members:
        for call in (lambda: hvd.broadcast_object("x", root_rank=0, process_set=ps),
                     lambda: hvd.broadcast_parameters([torch.zeros(2)], root_rank=0, process_set=ps)):
            try:  # no pytest.raises: a call that went through must not leave rank 0 at the barrier alone
                call()
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
    comm.Barrier()
    hvd.remove_process_set(ps)
    assert len(errors) == (2 if rank in members else 0)
    assert all(e is not None and "not in the process set" in e for e in errors)


@pytest.mark.mpi
def test_a_parameter_that_never_gets_a_gradient_may_be_an_integer():
    # Horovod's test_broadcast_state_no_grad: an int32 index parameter beside a trained one.
    class Indexed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.index = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
            self.weight = torch.nn.Parameter(torch.arange(4, dtype=torch.float64) + 1)

        def forward(self, x):
            return torch.index_select(self.weight, 0, self.index.long()) * x

    model, reference = Indexed(), Indexed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    x = torch.arange(2 * size, dtype=torch.float64).reshape(size, 2)
    opt.zero_grad()
    model(x[rank]).pow(2).sum().backward()
    opt.step()
    ref_opt.zero_grad()
    (sum(reference(row).pow(2).sum() for row in x) / size).backward()
    ref_opt.step()
    assert model.index.grad is None
    assert torch.equal(model.index, torch.tensor([1, 3], dtype=torch.int32))
    assert _close(model, reference, 1e-12)


@pytest.mark.mpi(min_size=2)
def test_buckets_are_handed_over_while_backward_runs(monkeypatch):
    # Horovod's fusion threshold sizes the buckets: 1 byte makes every gradient a bucket of its own.
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1")
    model, reference = _net(torch.float64), _net(torch.float64)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    during = []
    # The first layer's weight is among the last gradients backward makes: by then the later layers'
    # buckets must already be on their way (registered after the optimizer's hook, so it runs after it).
    model[0].weight.register_post_accumulate_grad_hook(lambda p: during.append(opt._buckets.started()))
    x, y = _batch(0, ROWS * size, torch.float64)
    opt.zero_grad()
    F.mse_loss(model(_mine(x)), _mine(y)).backward()
    opt.step()
    ref_opt.zero_grad()
    F.mse_loss(reference(x), y).backward()
    ref_opt.step()
    buckets = sum(len(r.buckets) for r in opt._buckets.reducers)
    assert buckets == 4 and len(during) == 1 and during[0] >= 2, (buckets, during)
    assert _close(model, reference, 1e-9)


@pytest.mark.mpi
@pytest.mark.parametrize("sparse_as_dense, predivide", [(False, 1.0), (True, 1.0), (False, 4.0)])
def test_sparse_gradients_are_averaged_and_stay_sparse(sparse_as_dense, predivide):
    # Each rank looks up its own rows; the reference sums every rank's lookups on one embedding.
    def build():
        torch.manual_seed(3)
        return torch.nn.Embedding(10, 3, sparse=True).double()

    emb, reference = build(), build()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5), sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=predivide)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ids = [torch.tensor([r % 10, (3 * r + 1) % 10, 7]) for r in range(size)]
    for _ in range(2):
        opt.zero_grad()
        emb(ids[rank]).square().sum().backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(reference(i).square().sum() for i in ids) / size).backward()
        ref_opt.step()
    assert emb.weight.grad.is_sparse
    assert torch.allclose(emb.weight, reference.weight, atol=1e-12)


def _square_net():
    """Two layers of the same shapes: ranks that swap them agree on every shape, so only names tell them apart."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6)).double()


def _loss(model, x, y):
    return F.mse_loss(model(x)[:, :y.shape[1]], y)


def _averaged_gradients(model, x, y):
    """Reference: this rank's gradients on a plain copy of ``model``, averaged by MPI's own Allreduce, by name.

    Collective: every rank must call it at the same point.
    """
    copy = pickle.loads(pickle.dumps(model))  # hooks are not pickled: a plain copy
    copy.zero_grad()
    _loss(copy, x, y).backward()
    averaged = {}
    for name, p in sorted(copy.named_parameters()):
        g = p.grad.numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, g)
        averaged[name] = torch.from_numpy(g / size)
    return averaged


def _reduced_gradients(opt, model, steps, keep_grads=False):
    """(the optimizer's reduced gradients, the reference's) for ``steps`` steps, by step and name."""
    got, want = [], []
    for step in range(steps):
        x, y = (_mine(t) for t in _batch(step, ROWS * size, torch.float64))
        want.append(_averaged_gradients(model, x, y))
        opt.zero_grad(set_to_none=not keep_grads)
        _loss(model, x, y).backward()
        opt.synchronize()
        got.append({name: p.grad.clone() for name, p in model.named_parameters()})
        with opt.skip_synchronize():
            opt.step()
    return got, want


def _assert_same_gradients(got, want):
    for step, (mine, theirs) in enumerate(zip(got, want)):
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-12, atol=1e-12,
                                       msg=lambda m, step=step, name=name: f"step {step}, {name}: {m}")


@pytest.mark.mpi
def test_predivide_applies_when_gradients_are_kept_between_steps():
    # zero_grad(set_to_none=False) keeps .grad, which after the first step is a view of its bucket slot:
    # the 1/f before the sum must still be applied, or the f/size after it leaves gradients f times too large.
    model = _net(torch.float64)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), gradient_predivide_factor=4.0)
    got, want = _reduced_gradients(opt, model, steps=3, keep_grads=True)
    _assert_same_gradients(got, want)


@pytest.mark.mpi
def test_ranks_that_list_parameters_in_different_orders_match_them_by_name():
    model = _square_net()
    named = list(model.named_parameters())  # weight, bias of layer 0, then of layer 2
    # Each of up to four ranks its own order of the optimizer's list and of the names. Rank 1 swaps the
    # layers, which keeps every shape in place: matched by position, its gradients would mix silently.
    turn = (0, 2, 1, 3)[rank % 4]
    named = named[turn:] + named[:turn]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9),
                                   named_parameters=named)
    got, want = _reduced_gradients(opt, model, steps=2)
    replicas = comm.allgather(b"".join(p.detach().numpy().tobytes() for _, p in sorted(model.named_parameters())))
    _assert_same_gradients(got, want)
    assert all(r == replicas[0] for r in replicas)


@pytest.mark.mpi
def test_parameters_are_averaged_in_place_under_no_grad():
    # The model-averaging idiom: in-place collectives on leaf parameters, as torch and Horovod allow.
    model = _net(torch.float64, seed=rank)
    params = [p for _, p in sorted(model.named_parameters())]
    want = []
    for p in params:
        w = p.detach().numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, w)
        want.append(torch.from_numpy(w / size))
    with torch.no_grad():  # averages: the sums are scaled in place too
        returned = [hvd.allreduce_(p, name=f"avg.{i}") for i, p in enumerate(params)]
        grouped = hvd.grouped_allreduce_(params, name="avg.grouped")  # an average of equal values changes none
        hvd.broadcast_(params[0], root_rank=size - 1, name="avg.root")
    assert all(r is p for r, p in zip(returned + grouped, params + params))
    assert all(p.requires_grad and isinstance(p, torch.nn.Parameter) for p in params)
    for i, (p, w) in enumerate(zip(params, want)):
        torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-12, msg=lambda m, i=i: f"parameter {i}: {m}")


@pytest.mark.mpi
def test_a_sparse_tensor_is_refused_with_the_fix():
    sparse = torch.ones(2 * size, 3).to_sparse()
    calls = {"allreduce": lambda: hvd.allreduce(sparse), "allreduce_": lambda: hvd.allreduce_(sparse),
             "grouped_allreduce": lambda: hvd.grouped_allreduce([sparse]),
             "broadcast": lambda: hvd.broadcast(sparse, 0), "broadcast_": lambda: hvd.broadcast_(sparse, 0),
             "allgather": lambda: hvd.allgather(sparse), "alltoall": lambda: hvd.alltoall(sparse),
             "reducescatter": lambda: hvd.reducescatter(sparse)}
    errors = {}
    for name, call in calls.items():
        try:  # every rank passes the same sparse tensor: refused on this rank before anything is sent
            call()
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    dense = hvd.allreduce(sparse.to_dense(), op=hvd.Sum, name="dense")
    total = hvd.sparse_allreduce_async(sparse, name="sparse", op=hvd.Sum)()
    assert all(e is not None and "\n" not in e and "sparse_allreduce_async" in e and "to_dense()" in e
               for e in errors.values()), errors
    assert torch.equal(total.to_dense(), dense) and torch.equal(dense, torch.full((2 * size, 3), float(size)))


@pytest.mark.mpi(min_size=2)
def test_nan_factors_on_every_rank_are_not_a_mismatch():
    out = hvd.allreduce(torch.ones(3), prescale_factor=float("nan"), name="nan-prescale")
    assert torch.isnan(out).all()


@pytest.mark.mpi(min_size=2)
def test_async_in_place_ops_take_a_parameter_under_no_grad():
    p = torch.nn.Parameter(torch.full((3,), float(rank)))
    with torch.no_grad():  # an average: the engine scales the sum in place
        out = hvd.synchronize(hvd.allreduce_async_(p, name="async-param"))
    assert out is p and torch.equal(p.detach(), torch.full((3,), sum(range(size)) / size))
