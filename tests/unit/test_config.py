import dataclasses

import pytest

from ringtrain.cli import build_parser
from ringtrain.commands.train import config_from_args
from ringtrain.training.config import FIELDS, MUST_MATCH, TrainConfig, load_config_file, validate
from ringtrain.errors import UsageError


def parse(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_defaults_when_nothing_given():
    assert parse() == TrainConfig()


def test_every_field_has_a_flag_and_help():
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for name, field in FIELDS.items():
        assert "--" + name.replace("_", "-") in text
        assert field.metadata["help"]


def test_must_match_names_are_fields():
    assert set(MUST_MATCH) <= set(FIELDS)


def test_precedence_defaults_file_flags(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('batch-size = 16\nlr = 0.2\nhidden = [64, 32]\noverlap = false\n')
    cfg = parse("--config", str(toml), "--lr", "0.3")
    assert (cfg.batch_size, cfg.lr, cfg.hidden, cfg.overlap) == (16, 0.3, (64, 32), False)
    assert cfg.epochs == TrainConfig().epochs


def test_yaml_config_and_train_table(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("epochs: 3\nhidden: 8,4\n")
    assert parse("--config", str(y)).hidden == (8, 4)
    t = tmp_path / "t.toml"
    t.write_text("[train]\nepochs = 4\n")
    assert parse("--config", str(t)).epochs == 4


def test_flags_types():
    cfg = parse("--hidden", "256,128", "--no-overlap", "--scale-lr", "--max-time", "2.5")
    assert cfg.hidden == (256, 128) and cfg.overlap is False and cfg.scale_lr is True and cfg.max_time == 2.5


@pytest.mark.parametrize("text,needle", [
    ("epochs = 'ten'\n", "setting 'epochs' must be int"),
    ("bogus = 1\n", "unknown setting 'bogus'"),
    ("epochs = \n", "not valid TOML"),
    ("batchsize = 3\n", "did you mean 'batch_size'"),
    ("epoch = 3\n", "unknown setting 'epoch'; did you mean 'epochs'\\?$"),
    ("shard-optimiser = true\n", "did you mean 'shard_optimizer'"),
    ("colour = 3\n", "unknown setting 'colour'$"),
])
def test_bad_config_file_is_one_line(tmp_path, text, needle):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(UsageError, match=needle) as info:
        load_config_file(str(f))
    assert "\n" not in str(info.value) and info.value.everywhere


def test_missing_and_wrong_kind_config(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_config_file(str(tmp_path / "nope.toml"))
    (tmp_path / "c.ini").write_text("x")
    with pytest.raises(UsageError, match="expected a .toml"):
        load_config_file(str(tmp_path / "c.ini"))


@pytest.mark.parametrize("change,needle", [
    ({"epochs": 0}, "--epochs: must be > 0"),
    ({"batch_size": -1}, "--batch-size: must be > 0"),
    ({"lr": float("nan")}, "--lr: must be a finite number"),
    ({"momentum": 1.0}, "--momentum: must be in [0, 1)"),
    ({"model": "mlpp"}, "unknown model 'mlpp'; choose one of cnn, mlp, softmax"),
    ({"hidden": ()}, "--hidden: the mlp needs at least one hidden layer"),
    ({"hidden": (0,)}, "--hidden: layer sizes must be > 0"),
    ({"optimizer": "rmsprop"}, "choose one of sgd, adam"),
    ({"allreduce": "tree"}, "--allreduce: unknown value 'tree'; choose one of auto, ring, mpi, hierarchical"),
    ({"test_fraction": 1.5}, "--test-fraction: must be between 0 and 1"),
    ({"resume": "/no/such/ckpt.npz"}, "--resume: no checkpoint at"),
    ({"classes": 1}, "--classes: must be at least 2"),
])
def test_validate_names_flag_and_problem(change, needle):
    with pytest.raises(UsageError) as info:
        validate(dataclasses.replace(TrainConfig(), **change))
    assert needle in str(info.value)


def test_bad_hidden_flag_is_usage_error():
    with pytest.raises(UsageError, match="expected comma-separated integers"):
        parse("--hidden", "12,x")
