"""What a request asks for: the engine's settings, a row's sampling settings, their vocabularies.

``rollout_config`` holds :class:`RolloutConfig` (the engine's, fixed for its lifetime),
``sampling_params`` :class:`SamplingParams` (a row's) with its vLLM and ``GenerationConfig``
doors, ``vocabulary`` the names of both vocabularies, ``field_types`` the annotation-driven type
check both dataclasses run, ``call`` the one normaliser a call's settings pass through, and
``generate_call`` how a ``generate()`` call's settings resolve (the drop-in's door).
"""

from graphcap.rollout.settings.call import CallSettings, RequestSettings, normalise_request
from graphcap.rollout.settings.rollout_config import RolloutConfig
from graphcap.rollout.settings.sampling_params import SamplingParams

__all__ = [
    "CallSettings",
    "RequestSettings",
    "RolloutConfig",
    "SamplingParams",
    "normalise_request",
]
