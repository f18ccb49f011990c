"""Data-parallel training written against the ringtrain library, loop in plain sight.

Run it on 2 ranks:

    mpirun -np 2 python scripts/train_library.py

The ringtrain calls, Horovod-example style: TaskSpec.from_mpi (where am I),
load_sharded (my shard), broadcast_ (start identical), allreduce_many_
(average the gradients), reduce_eval (exact global accuracy).
"""

import ringtrain

EPOCHS, BATCH, LR = 20, 32, 0.1

with ringtrain.abort_on_error():  # an exception on one rank ends the whole job, not just this rank
    spec = ringtrain.TaskSpec.from_mpi()
    data = ringtrain.load_sharded("digits", seed=0)
    model = ringtrain.build_model("mlp", data.num_features, data.num_classes, hidden=(128,), seed=0)
    opt = ringtrain.build_optimizer("sgd", model.params, lr=LR, momentum=0.9)
    for p in model.params.values():
        ringtrain.broadcast_(p, root=0)  # every replica starts from rank 0's weights

    plan = ringtrain.EpochPlan.for_shard(data, batch_size=BATCH, seed=0)  # same steps on every rank
    for epoch in range(EPOCHS):
        for _step, rows in plan.batches(epoch):
            loss, grads, correct = model.loss_and_grad(data.x[rows], data.y[rows])
            ringtrain.allreduce_many_(list(grads.values()), op="mean")
            opt.step(model.params, grads, LR)
        totals = ringtrain.reduce_eval(model, data)
        if spec.is_master:
            print(f"epoch {epoch + 1}: test accuracy {totals.accuracy:.2%} on {totals.count} samples")
