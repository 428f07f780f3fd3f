"""The scheduler's configuration and its per-feature rules (``halserve.scheduler`` calls them).

``SchedulerConfig``: limits and switches. ``AdmissionPolicy``: the common shape of an admission
rule (``base.py``); the rules: ``GrammarGate`` (structured outputs), ``PipelineStages`` (batches
in flight), ``UnservedFeatures`` (refusals), and LoRA's ``halserve.lora.admission.LoRAAdmission``.
Helpers the steps call: ``DraftRule`` (speculative decoding), ``ConnectorLoads`` (KV connector),
and ``halserve.multimodal.budget.fit_encoder_budget`` (image budget); ``AsyncSteps`` (async
scheduling's placeholders); ``PriorityWaitingQueue`` (the ``priority`` policy's waiting queue).
"""
from halserve.sched.async_steps import AsyncSteps
from halserve.sched.base import Admission, AdmissionPolicy, UnservedFeatures
from halserve.sched.config import SchedulerConfig
from halserve.sched.drafts import DraftRule, make_spec_proposer
from halserve.sched.grammar import GrammarGate
from halserve.sched.kv_loads import ConnectorLoads
from halserve.sched.priority import PriorityWaitingQueue
from halserve.sched.stages import PipelineStages

__all__ = [
    "Admission",
    "AdmissionPolicy",
    "AsyncSteps",
    "ConnectorLoads",
    "DraftRule",
    "GrammarGate",
    "PipelineStages",
    "PriorityWaitingQueue",
    "SchedulerConfig",
    "UnservedFeatures",
    "make_spec_proposer",
]
