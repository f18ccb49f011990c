"""Bring your own model: implement three things and hand it to ringtrain.train.

    mpirun -np 2 python scripts/custom_model.py

A model is ``params`` (an ordered dict of arrays, updated in place by the
optimizer), ``loss_and_grad(x, y, on_grad=None)`` returning
``(mean loss, grads like params, number correct)``, and ``logits(x)``;
subclassing ringtrain.Model gives ``evaluate`` for free. Write it against an
array module ``xp`` and the same code runs on NumPy and CuPy.
"""

import numpy as np

import ringtrain
from ringtrain.models import softmax_cross_entropy


class TanhNet(ringtrain.Model):
    """x -> tanh(x W1 + b1) -> W2 + b2, with the backward pass written out."""

    def __init__(self, num_features, num_classes, hidden=64, seed=0, xp=np):
        rng = np.random.default_rng(seed)
        self.xp = xp
        self.params = {
            "w1": xp.asarray(rng.normal(0, 1 / np.sqrt(num_features), (num_features, hidden)).astype(np.float32)),
            "b1": xp.zeros(hidden, np.float32),
            "w2": xp.asarray(rng.normal(0, 1 / np.sqrt(hidden), (hidden, num_classes)).astype(np.float32)),
            "b2": xp.zeros(num_classes, np.float32),
        }

    def logits(self, x):
        p = self.params
        return self.xp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def loss_and_grad(self, x, y, on_grad=None):
        p, xp = self.params, self.xp
        h = xp.tanh(x @ p["w1"] + p["b1"])
        loss_sum, correct, dz = softmax_cross_entropy(h @ p["w2"] + p["b2"], y, grad_scale=1.0 / len(x))
        grads = {"b2": dz.sum(axis=0), "w2": h.T @ dz}
        dh = (dz @ p["w2"].T) * (1 - h * h)
        grads.update(b1=dh.sum(axis=0), w1=x.T @ dh)
        if on_grad is not None:  # reverse layer order, as each gradient becomes final
            for name in ("b2", "w2", "b1", "w1"):
                on_grad(name, grads[name])
        return loss_sum / len(x), {name: grads[name] for name in p}, correct


with ringtrain.abort_on_error():
    config = ringtrain.TrainConfig(dataset="digits", epochs=20, lr=0.1, progress=False, resume="none",
                                   run_dir="runs/custom-model")
    data = ringtrain.load_sharded(config.dataset, seed=config.seed)
    result = ringtrain.train(config, model=TanhNet(data.num_features, data.num_classes))
    if ringtrain.TaskSpec.from_mpi().is_master:
        print(f"custom model: test accuracy {result.eval['accuracy']:.2%}")
