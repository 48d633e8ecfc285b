"""Bad settings end in a ``ValueError`` that names the setting, the value and the fix: at construction when the
value alone is wrong, at setup (on every rank alike, never a hang) when it conflicts with the job."""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.parallel import Cluster, UnknownArgumentError
from tests.parallel.common import TinyLM, loader, make_trainer, token_data


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0 must be a positive integer"),
    (dict(placement="rack_local"), "placement='rack_local' is not a placement policy"),
    (dict(plan=["fc1"]), "plan=\\['fc1'\\] must be 'auto' or a dict"),
    (dict(cluster={"topology": "0,1"}), "must be a lightning_deepseek.parallel.Cluster"),
])
def test_bad_arguments_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError, KeyError), match=message):
        HybridParallelStrategy(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(topology="0-1"), "cluster.topology='0-1' is not a topology"),
    (dict(link_costs={"intra": {"bandwidth_gbit": 100}}), "cluster.link_costs\\['inter'\\]"),
])
def test_bad_cluster_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Cluster(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(placment="auto"), "unknown argument placment='auto': did you mean placement?"),
    (dict(tensor_paralel_size=2), "unknown argument tensor_paralel_size=2: did you mean tensor_parallel_size?"),
    (dict(find_unused_parameter=True), "did you mean find_unused_parameters?"),  # DDP's own argument
    (dict(no_such_setting=1), "unknown argument no_such_setting=1: HybridParallelStrategy takes tensor_parallel_size"),
    (dict(device_ids=[0]), "Lightning sets DistributedDataParallel's device_ids itself"),
])
def test_misspelt_keyword_fails_at_construction_with_the_closest_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(UnknownArgumentError, match=re.escape(message)):
        HybridParallelStrategy(**kwargs)


def test_ddp_and_ddp_strategy_keywords_still_pass_through() -> None:
    environment = LightningEnvironment()
    strategy = HybridParallelStrategy(find_unused_parameters=True, bucket_cap_mb=5, cluster_environment=environment)
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 5}
    assert strategy.cluster_environment is environment


def test_misspelt_lds_train_override_names_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_deepseek.app.cli import CONFIG_DIR
    from lightning_deepseek.app.errors import exit_on_user_error

    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["strategy=hybrid", "+strategy.tensor_paralel_size=2"])
    with pytest.raises(InstantiationException) as raised:
        instantiate(cfg.strategy)
    with pytest.raises(SystemExit) as exited:
        exit_on_user_error(raised.value)  # what lds-train does with it: one paragraph, exit code 2
    assert exited.value.code == 2
    assert "unknown argument tensor_paralel_size=2: did you mean tensor_parallel_size?" in capsys.readouterr().err


def test_registered_as_hybrid() -> None:
    trainer = pl.Trainer(strategy="hybrid", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)


def setup_errors(world_size: int) -> dict[str, str]:
    """Message of each bad setting at ``Trainer.fit`` (run on 2 ranks by the ``two_ranks`` fixture)."""
    cases = {
        "tp_not_dividing": (dict(tensor_parallel_size=3), {}),
        "ff_not_divisible": (dict(tensor_parallel_size=2, min_shard_params=0), dict(n_embd=33, n_head=3, mlp_ratio=3)),
        "pattern_matches_nothing": (dict(tensor_parallel_size=2, plan={"*.ffn.w1": "colwise"}), {}),
        "topology_mismatch": (dict(tensor_parallel_size=2, cluster=Cluster(topology="0,1,2")), {}),
    }
    messages = {}
    for name, (strategy_kwargs, model_kwargs) in cases.items():
        trainer = make_trainer(world_size, HybridParallelStrategy(**strategy_kwargs), max_steps=1)
        try:
            trainer.fit(TinyLM(**model_kwargs), loader(token_data(8), 2))
            messages[name] = "no error"
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


@pytest.mark.parametrize(("case", "message"), [
    ("tp_not_dividing", "tensor_parallel_size=3 does not divide the world size 2. Choose one of [1, 2]"),
    ("ff_not_divisible", "tensor_parallel_size=2 divides none of the feed-forward widths [99]"),
    ("pattern_matches_nothing", "plan pattern '*.ffn.w1' matches no module"),
    ("topology_mismatch", "topology declares ranks [0, 1, 2] but the job has world size 2"),
])
def test_bad_settings_fail_at_setup_on_every_rank(two_ranks: dict[str, Any], case: str, message: str) -> None:
    for rank_messages in two_ranks["setup_errors"]:
        assert message in rank_messages[case]
