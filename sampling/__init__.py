"""On-device sampling: per-step metadata, the sampler, and logprobs."""
from halserve.sampling.metadata import SamplingMetadata, seed_for_step, takes_argmax_only
from halserve.sampling.sampler import Sampler

__all__ = ["Sampler", "SamplingMetadata", "seed_for_step", "takes_argmax_only"]
