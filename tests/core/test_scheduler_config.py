"""SchedulerConfig validation and derivation; which feature rules a scheduler is built with."""
import dataclasses

import pytest

from halserve.lora.admission import LoRAAdmission
from halserve.sched import GrammarGate, PipelineStages, SchedulerConfig, UnservedFeatures
from halserve.scheduler import Scheduler

BASE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=8, num_blocks=16)


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                                   "max_concurrent_batches", "max_loras"])
def test_bad_limits_are_refused_quoting_the_value(field):
    with pytest.raises(ValueError, match=rf"{field} must be >= 1.*got 0"):
        SchedulerConfig(**{**BASE, field: 0})


def test_config_is_frozen():
    config = SchedulerConfig(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 8


def test_from_engine_config_derives_every_field():
    from halserve.config import EngineConfig

    engine = EngineConfig(model="m", max_num_seqs=3, max_num_batched_tokens=40, block_size=4,
                          enable_prefix_caching=False, enable_lora=True, max_loras=2)
    config = SchedulerConfig.from_engine_config(engine, num_blocks=12, max_model_len=96, max_concurrent_batches=2)
    assert config == SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=40, max_model_len=96, block_size=4,
                                     num_blocks=12, enable_prefix_caching=False, max_loras=2,
                                     pipeline_parallel=False, max_concurrent_batches=2)
    assert SchedulerConfig.from_engine_config(EngineConfig(model="m"), num_blocks=12, max_model_len=96).max_loras is None


def test_a_plain_scheduler_gates_nothing():
    sched = Scheduler(SchedulerConfig(**BASE))
    assert [type(p) for p in sched.policies] == [UnservedFeatures, PipelineStages]
    assert sched._gates == []  # (one batch at a time, no grammars, no LoRA: admission asks no rule)
    assert sched.config.max_num_seqs == sched.max_num_seqs == 4


def test_feature_rules_are_gates_in_order():
    class Manager:  # (a StructuredOutputManager's scheduler-facing surface)
        def is_ready(self, request):
            return True

    sched = Scheduler(SchedulerConfig(**BASE, max_loras=1, max_concurrent_batches=2), structured_outputs=Manager())
    assert [type(p) for p in sched._gates] == [PipelineStages, GrammarGate, LoRAAdmission]


def test_a_kv_connector_with_batches_in_flight_is_refused():
    with pytest.raises(ValueError, match="batches in flight"):
        Scheduler(SchedulerConfig(**BASE, max_concurrent_batches=2), kv_connector=object())
