"""The decision of the ``"auto"`` settings without processes: the candidates, the memory filter, the margin rule and
the choice where nothing was timed; and the settings' own checks."""

from __future__ import annotations

import pytest

from lightning_deepseek.autotune.decision import (
    Candidate,
    ModelMemory,
    NoCandidateFitsError,
    candidates,
    choose,
    decide,
    fitting,
)
from lightning_deepseek.compression import CompressionConfig

GIB = 2**30
PLAIN, INT8, INT4, TP2 = Candidate(), Candidate(1, 1, 8), Candidate(1, 1, 4), Candidate(2)
OPTIONS = [PLAIN, INT8, INT4, TP2]


def gpt(param_gib: float, ffn_share: float = 0.9, activation_gib: float = 1.0) -> ModelMemory:
    """A GPT-like model of ``param_gib`` GiB of fp32 parameters, ``ffn_share`` of them sharded by its tp=2 plan."""
    total = int(param_gib * GIB)
    sharded = int(total * ffn_share)
    return ModelMemory({1: total, 2: total - sharded}, {2: sharded // 2}, activation_bytes=int(activation_gib * GIB))


def test_memory_per_rank_counts_states_residual_and_activations_and_shrinks_with_sharding() -> None:
    memory = gpt(1.0, activation_gib=0.5)
    assert memory.bytes_per_rank(PLAIN) == 4 * GIB + GIB // 2  # parameters, gradients, two Adam states
    assert memory.bytes_per_rank(INT8) == memory.bytes_per_rank(PLAIN) + GIB  # the fp32 error-feedback residual
    assert memory.bytes_per_rank(TP2) < 0.7 * memory.bytes_per_rank(PLAIN)
    experts = ModelMemory({1: 4 * GIB}, expert_bytes=2 * GIB)
    assert experts.exchanged_bytes(Candidate(1, 2)) == 2 * GIB  # the experts leave DDP's exchange at ep > 1
    assert experts.bytes_per_rank(Candidate(1, 2)) == 4 * 3 * GIB  # and one rank holds half of them


def test_the_memory_filter_drops_what_does_not_fit_simplest_first() -> None:
    # 3 GiB of parameters x (1 param + 1 grad + 2 Adam states) + 1 GiB of activations: 13 GiB against 10 usable
    assert fitting(OPTIONS, gpt(3), 10 * GIB, "tensor_parallel_size='auto'") == [TP2]
    assert fitting(reversed(OPTIONS), gpt(0.1), 10 * GIB, "x") == OPTIONS


def test_a_model_too_large_for_every_candidate_names_the_setting_and_the_fixes() -> None:
    with pytest.raises(NoCandidateFitsError, match=r"tensor_parallel_size='auto': no candidate fits the device "
                       r"memory: the smallest, tp=2 ep=1 fp32, needs .* GiB per rank .*shard_optimizer_states=True"):
        fitting(OPTIONS, gpt(3), 4 * GIB, "tensor_parallel_size='auto'")


def test_plain_ddp_stays_unless_another_is_timed_faster_by_the_margin() -> None:
    assert choose(OPTIONS, {PLAIN: 0.100, INT8: 0.097, INT4: 0.099, TP2: 0.120}) == (
        PLAIN, "nothing is timed 5% or more faster")
    chosen, reason = choose(OPTIONS, {PLAIN: 0.100, INT8: 0.090, INT4: 0.099, TP2: 0.120})
    assert chosen == INT8 and reason == "timed 1.11x faster than tp=1 ep=1 fp32"
    assert choose(OPTIONS, {PLAIN: 0.100, INT8: 0.090}, margin=0.15)[0] == PLAIN


def test_of_those_beating_the_margin_the_simplest_within_it_of_the_fastest_is_chosen() -> None:
    # tp=2 fastest, int8 within 5% of it: compression is simpler than sharding, so it is kept
    chosen, reason = choose(OPTIONS, {PLAIN: 0.100, INT8: 0.082, INT4: 0.090, TP2: 0.080})
    assert chosen == INT8
    assert reason == "timed 1.22x faster than tp=1 ep=1 fp32 (and within 5% of the fastest, tp=2 ep=1 fp32)"


def test_where_nothing_was_timed_the_simplest_layout_that_fits_is_kept_and_the_reason_says_why() -> None:
    decision = decide(OPTIONS, gpt(0.1), 10 * GIB, {}, "x", untimed="nothing timed: repeats=0")
    assert decision.chosen == PLAIN
    assert decision.reason == "the simplest layout that fits (nothing timed: repeats=0)"
    assert all(e.seconds is None for e in decision.entries) and "not timed" in decision.table()
    squeezed = decide(OPTIONS, gpt(3), 10 * GIB, {}, "x", untimed="nothing timed: no room")
    assert squeezed.chosen == TP2
    assert squeezed.reason == ("memory requires it (tp=1 ep=1 fp32 does not fit); the simplest layout that fits "
                               "(nothing timed: no room)")


def test_the_decision_lists_every_candidate_fastest_first_and_summarises_the_choice() -> None:
    seconds = {PLAIN: 0.100, INT8: 0.090, INT4: 0.095, TP2: 0.120}
    decision = decide(OPTIONS, gpt(0.1), 10 * GIB, seconds, "x", tokens=64, source="4 copies timed")
    assert [e.candidate for e in decision.entries] == [INT8, INT4, PLAIN, TP2]
    assert decision.chosen == INT8 and decision.tokens == 64 and decision.entry(TP2).seconds == 0.120
    table = decision.table()
    assert "tp=1 ep=1 int8" in table and "90.0 ms" in table and "<- chosen" in table
    assert table.endswith("choice: tp=1 ep=1 int8: timed 1.11x faster than tp=1 ep=1 fp32")
    summary = decision.summary()
    assert summary["autotune_choice"] == "tp=1 ep=1 int8"
    assert summary["autotune_predicted_ms"] == {"tp=1 ep=1 int8": 90.0, "tp=1 ep=1 int4": 95.0,
                                                "tp=1 ep=1 fp32": 100.0, "tp=2 ep=1 fp32": 120.0}


def test_candidates_skip_sizes_that_do_not_divide_and_compression_without_data_parallel_ranks() -> None:
    assert candidates(2, [1, 2], [1], [None, 8]) == [Candidate(1, 1, None), Candidate(1, 1, 8), Candidate(2, 1, None)]
    assert candidates(2, [1, 2], [1], [8]) == [Candidate(1, 1, 8), Candidate(2, 1, None)]  # fixed bits, dp=1
    assert Candidate(3) not in candidates(4, [1, 2, 3], [1], [None])
    assert Candidate(2, 2) in candidates(4, [1, 2], [1, 2], [None])  # sharded both ways


def test_bits_auto_is_a_config_value_only_the_callback_decides() -> None:
    assert CompressionConfig(bits="auto").bits == "auto"
    with pytest.raises(ValueError, match="bits='auto' is decided by the GradientCompression callback"):
        CompressionConfig(bits="auto").check_decided("register_compression_hook")
    with pytest.raises(ValueError, match="bits='eight' is not supported"):
        CompressionConfig(bits="eight")


def test_lds_train_compression_auto_preset_builds_the_callback() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_deepseek.app.cli import CONFIG_DIR

    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["compression=auto"])
    assert instantiate(cfg.compression.callback).config.bits == "auto"


def test_per_node_is_accepted_and_bad_values_name_both_words() -> None:
    from lightning_deepseek.parallel import HybridParallelStrategy

    HybridParallelStrategy(tensor_parallel_size="per_node", expert_parallel_size="per_node")
    with pytest.raises(ValueError, match="tensor_parallel_size='node' must be a positive integer.* 'auto' .*"
                                         "'per_node'"):
        HybridParallelStrategy(tensor_parallel_size="node")
    with pytest.raises(ValueError, match="expert_parallel_size=0 must be a positive integer.* 'auto'"):
        HybridParallelStrategy(expert_parallel_size=0)


def test_bits_auto_on_one_device_is_an_error_naming_the_fix() -> None:
    from lightning_deepseek.compression import GradientCompression
    from tests.parallel.common import TinyLM, loader, make_trainer, token_data

    trainer = make_trainer(1, "auto", max_steps=1, callbacks=[GradientCompression(bits="auto")])
    with pytest.raises(ValueError, match=r"GradientCompression\(bits='auto'\) with 1 data-parallel rank .*Train on 2 "
                                         "or more devices, or remove GradientCompression"):
        trainer.fit(TinyLM(), loader(token_data(4), 2))


def test_parameter_sharding_candidates_divide_everything_by_the_shard_size_and_respect_the_groups() -> None:
    memory = ModelMemory({1: 8 * GIB, 2: 4 * GIB}, {2: 2 * GIB}, expert_bytes=2 * GIB)
    # 8 GiB replicated: parameters, gradients and two Adam states, 1/4 each over 4 shard ranks
    assert memory.bytes_per_rank(Candidate(dp_shard=4)) == memory.bytes_per_rank(PLAIN) // 4 == 8 * GIB
    # tp=2 with shard groups of 4: the replicated 4 GiB over 4, the 2 GiB tp shard over 2 of its replicas
    assert memory.bytes_per_rank(Candidate(2, dp_shard=4)) == (4 * GIB // 4 + 2 * GIB // 2) * 4
    # ep=4 spans the shard groups of 2: the experts' slices are replicated, the rest (6 GiB) sharded
    assert memory.bytes_per_rank(Candidate(1, 4, dp_shard=2)) == (6 * GIB // 2 + 2 * GIB // 4) * 4
    options = candidates(12, [1, 2], [1, 4], [None, 8], shard_sizes=[1, 6, 12])
    assert Candidate(1, 4, None, 6) not in options  # 6 ranks would cut an ep=4 group
    assert {c.bits for c in options if c.dp_shard > 1} == {None}  # the copies compress DDP's exchange only
    assert Candidate(2, 1, None, 6) in options and Candidate(1, 4, None, 12) in options
    assert Candidate(1, 1, None, 6).label == "tp=1 ep=1 dp_shard=6 fp32"
    assert fitting([Candidate(dp_shard=4), PLAIN], memory, 10 * GIB, "x") == [Candidate(dp_shard=4)]


def test_shard_size_candidates_are_those_gradient_compression_can_compress() -> None:
    from lightning_deepseek.autotune.auto_parallel import shard_sizes

    assert shard_sizes(16, 8, None) == [1, 8, 16] and shard_sizes(6, 4, None) == [1, 6]
    assert shard_sizes(16, 8, 8) == [1, 16]  # HSDP's all-reduce across the replicas would stay uncompressed
    assert shard_sizes(16, 8, "auto") == [1]  # the copies deciding the bits compress DDP's exchange only
