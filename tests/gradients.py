"""The finite-difference reference the model tests check analytic gradients against."""

import numpy as np

from ringtrain import backend


def finite_difference_check(model, x, y, eps=1e-6):
    """Assert every gradient of ``model.loss_and_grad`` matches central differences of its loss."""
    _, grads, _ = model.loss_and_grad(x, y)
    grads = {k: backend.to_numpy(g).copy() for k, g in grads.items()}
    for name, p in model.params.items():
        numeric = np.zeros(p.shape)
        flat = p.reshape(-1)  # a view: perturbing it perturbs the model
        for j in range(flat.size):
            old = float(flat[j])
            flat[j] = old + eps
            up = model.loss_and_grad(x, y)[0]
            flat[j] = old - eps
            down = model.loss_and_grad(x, y)[0]
            flat[j] = old
            numeric.reshape(-1)[j] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-5, atol=1e-8, err_msg=name)
