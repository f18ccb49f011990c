"""Handing a module's gradients to a consumer as backward makes them final, in a fixed order.

:class:`GradientFeed` is how :class:`~ringtrain.torch.TorchModel` overlaps
the trainer's bucketed reduction with backward. A hook after each
parameter's gradient accumulation marks it ready; the feed delivers
gradients strictly in the order it was given (the reverse of the
parameters': backward's usual order), each as soon as it and every one
before it are ready, so the consumer's buckets fill and start in the same
order on every rank. What backward never reached is delivered when it ends.
"""

import contextlib
import functools

__all__ = ["GradientFeed"]


class GradientFeed:
    """Deliver ``(name, gradient)`` pairs in order while backward runs.

    Args:
        named: ``[(name, parameter)]`` in delivery order; a hook is registered on each.
        gradient: ``gradient(name)``, the array handed to the consumer.
        synchronize: called before each delivery (a GPU's queued kernels must
            finish before the consumer, MPI or a peer reads the memory).
    """

    def __init__(self, named, gradient, synchronize):
        self.names = [name for name, _ in named]
        self.gradient, self.synchronize = gradient, synchronize
        self._consumer, self._ready, self._delivered = None, [False] * len(self.names), 0
        for i, (_, p) in enumerate(named):
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))

    @contextlib.contextmanager
    def delivering(self, consumer):
        """Deliver to ``consumer(name, grad)`` during the block (None: deliver nothing); the rest at its end."""
        self._consumer, self._delivered = consumer, 0
        self._ready = [False] * len(self.names)
        try:
            yield
            if consumer is not None:
                self._flush(len(self.names))
        finally:
            self._consumer = None

    def _grad_ready(self, i, _param):
        # Runs inside backward, once the gradient has been added to .grad.
        if self._consumer is None:
            return
        self._ready[i] = True
        count = self._delivered
        while count < len(self._ready) and self._ready[count]:
            count += 1
        self._flush(count)

    def _flush(self, count):
        """Deliver gradients ``[delivered, count)``."""
        if count <= self._delivered:
            return
        self.synchronize()
        for name in self.names[self._delivered:count]:
            self._consumer(name, self.gradient(name))
        self._delivered = count
