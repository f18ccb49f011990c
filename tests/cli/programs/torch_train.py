"""``ringtrain train`` on a torch CNN through TorchModel, with one fault injected on one rank.

Usage::

    python torch_train.py FAULT RANK STEP [ringtrain train flags...]

The model is a small torch CNN for 8x8 one-channel images (``--dataset
digits``), built from ``torch.manual_seed(seed)`` and handed to the library's
trainer with ``model=``. FAULT is one of faulty_train.py's, injected the same
way (its ``inject`` replaces ``loss_and_grad`` on the instance), so the
faulty run takes the same strategy as the straight run it is compared with.
At the end every rank prints ``rank R digest <sha256>`` of its parameters.
"""

import os
import sys

import torch
from mpi4py import MPI

import ringtrain.training.loop
from faulty_train import inject  # this directory is on sys.path: it is the script's
from ringtrain.cli import build_parser
from ringtrain.commands.train import config_from_args
from ringtrain.errors import UsageError
from ringtrain.failure import abort_on_error
from ringtrain.torch import TorchModel
from ringtrain.training.replicas import params_digest


def digits_cnn(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10),
    )


def main(argv):
    fault, rank, at, flags = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    comm = MPI.COMM_WORLD
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        with abort_on_error(comm):
            cfg = config_from_args(build_parser().parse_args(["train", *flags]))
            model = TorchModel(digits_cnn(cfg.seed), input_shape=(1, 8, 8))
            if comm.Get_rank() == rank and fault != "none":
                inject(model, fault, at)
            result = ringtrain.training.loop.train(cfg, comm, model=model)
            sys.stdout.write(f"rank {comm.Get_rank()} digest {params_digest(result.params)}\n")
            sys.stdout.flush()
    except UsageError as exc:
        print(f"rank {comm.Get_rank()}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
