"""The model runner for XLA devices (the tpu platform).

XLA compiles one graph per distinct set of input shapes, so every step is padded to a
(token bucket, request bucket) pair (``xla_buckets``): a run compiles at most
``len(token buckets) * len(request buckets)`` graphs. Inputs are built on the host and
copied once per step; the step ends with one ``torch_xla.sync()``, after which the
padded logits come back whole (slicing by a real count on the device would make a new
graph per count) and sampling runs on the host. No data-dependent Python control flow
happens between the copy and the sync. torch-xla cannot run under ``inference_mode``,
so steps run under ``no_grad``.
"""
from __future__ import annotations

import torch

from halserve.worker.model_runner import ModelRunner, StepInputs
from halserve.worker.xla_buckets import metadata_to_device, pad_step


class XlaModelRunner(ModelRunner):
    grad_mode = staticmethod(torch.no_grad)
    supports_pooling = False  # (embedding requests end without an embedding: the API says so)
    supports_speculative_decoding = False  # (its buckets pad one logits row per request)
    supports_pipeline_parallel = False  # (its compiled graph is the whole model)
    supports_multimodal = False  # (images would add a data-dependent encoder pass to its graph)
    supports_kv_connector = False  # (its _forward runs the compiled graph without the connector's hooks)
    supports_hybrid_kv_cache = False  # (its _forward builds one block table for every layer)

    def load_model(self) -> None:
        if self.info.runner == "pooling":  # (its requests all classify, which needs pooling)
            raise ValueError(f"{self.info.architecture} is a classification model, which the XLA model runner "
                             f"(platform {self.platform.name}) cannot serve: it does not pool; use another platform")
        super().load_model()

    def warm_up(self) -> None:
        """Nothing: XLA compiles one graph per padded shape, on first use of each bucket;
        an eager dummy run here would only add compilations outside the bucketing bound."""

    def _forward(self, step: StepInputs) -> torch.Tensor:
        import torch_xla

        padded = pad_step(
            step.common,
            step.input_ids,
            step.positions,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            max_blocks_per_req=self.max_blocks_per_req,
        )
        dev = self.device
        attn_metadata = self.attn_backend_cls.build_metadata(metadata_to_device(padded.metadata, dev))
        from halserve.forward_context import set_forward_context

        with set_forward_context(attn_metadata):
            hidden = self.model(padded.input_ids.to(dev), padded.positions.to(dev))
        if step.prompt_indices:  # (the real tokens lead the padded batch; one more graph per count)
            self._score_prompt(step, hidden)
        # [R_pad, vocab]: the last token of every (padded) request
        logits = self.model.compute_logits(hidden.index_select(0, padded.logits_indices.to(dev)))
        torch_xla.sync()
        if not step.sample_rows:  # a prefill chunk: the step only wrote the KV cache
            return None
        logits = logits.cpu()
        return logits.index_select(0, torch.tensor(step.sample_rows, dtype=torch.long))
