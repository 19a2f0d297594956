"""``unmask serve --ray``'s options are checked before Ray is imported or a model loads (docs/scale.md): a value
out of range names its flag or variable; tensor parallelism is refused with --ray."""
from __future__ import annotations

import pytest

from unmask.cli import UsageError
from unmask.cli.flags import resolve_env
from unmask.cli.main import build_parser
from unmask.cli.serve import configs
from unmask.cli.serve_ray import ray_options


def _options(*argv: str):
    args = resolve_env(build_parser().parse_args(["serve", "ckpt", "--ray", *argv]))
    return ray_options(args, configs(args)[0])


def test_bad_values_name_their_flag():
    with pytest.raises(UsageError, match="--ray-max-replicas: must be >= ray_min_replicas"):
        _options("--ray-min-replicas", "3", "--ray-max-replicas", "2")
    with pytest.raises(UsageError, match="--ray-imbalance"):
        _options("--ray-imbalance", "-1")


def test_tensor_parallelism_is_refused_with_ray():
    with pytest.raises(UsageError, match="--tensor-parallel-size: not with --ray"):
        _options("--tensor-parallel-size", "2")
