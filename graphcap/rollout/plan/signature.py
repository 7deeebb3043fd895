"""The graph signature: every host value a captured step depends on.

Rule: whatever the captured step reads on the host is either a device tensor the step updates
itself or a member of this signature. Two calls with equal signatures may replay the same graph;
any difference means recapture. Tensor *contents* are not members, so in-place weight updates
keep the graph (replay reads the new values); addresses, shapes, strides, dtypes and devices are.
The Python-level state forward reads (hooks, primitive module attributes, adapter state, packed
weights) is the ``host_state`` member (see :mod:`graphcap.rollout.plan.fingerprint`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcap.rollout.plan.fingerprint import HostState
from graphcap.rollout.plan.scan import ModelScan, TensorFacts
from graphcap.rollout.sampling import SamplerShape


def autocast_state(device_type: str) -> tuple[bool, torch.dtype | None, bool]:
    """(enabled, dtype, weight-cache enabled) of autocast for ``device_type``."""
    enabled = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if enabled else None
    return enabled, dtype, torch.is_autocast_cache_enabled() if enabled else False


def attention_implementation(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    # private: transformers sets the implementation through set_attn_implementation() but has
    # no public getter; this property is what its own modeling code reads
    return str(getattr(config, "_attn_implementation", None) or "eager")


@dataclass(frozen=True)
class GraphSignature:
    """What a captured decode step was built for."""

    batch_size: int
    total_len: int
    device: torch.device
    dtype: torch.dtype
    tensors: tuple[TensorFacts, ...]
    training: tuple[bool, ...]
    autocast: tuple[bool, torch.dtype | None, bool]
    inference_mode: bool
    attn_implementation: str
    sampler: SamplerShape  # settings are per-row device inputs; only the shape is here
    pad_id: int
    mask_form: str
    windows: tuple[tuple[str, int | None], ...]
    generator_id: int | None
    host_state: HostState
    #: per-position graphs bake the prompt width into their attended spans
    prompt_width: int | None = None
    #: per-position graphs: one graph per decode step
    decode_steps: int | None = None
    #: captured steps run the torch.compile'd forward
    compiled: bool = False
    #: K/V in a block table of this block size (``None``: the static cache); the pool's own
    #: size changes within a call and is checked by the holder against each graph
    kv_block_size: int | None = None

    def differences(self, other: GraphSignature) -> list[str]:
        """Names of the members that differ (for stats and logs); ``host_state`` also says
        what changed, e.g. ``"host_state (model.layers.0: forward hooks)"``."""
        changed = []
        for name in self.__dataclass_fields__:
            if getattr(self, name) == getattr(other, name):
                continue
            if name == "host_state":
                name += f" ({'; '.join(self.host_state.differences(other.host_state))})"
            changed.append(name)
        return changed


def signature_of(
    scan: ModelScan,
    *,
    batch_size: int,
    total_len: int,
    device: torch.device,
    sampler: SamplerShape,
    pad_id: int,
    mask_form: str,
    windows: dict[str, int | None],
    generator: torch.Generator | None,
    attention: str,
    prompt_width: int | None = None,
    decode_steps: int | None = None,
    compiled: bool = False,
    kv_block_size: int | None = None,
) -> GraphSignature:
    """The signature a decode step for this request would have."""
    return GraphSignature(
        batch_size=batch_size,
        total_len=total_len,
        device=device,
        dtype=scan.dtype,
        tensors=scan.tensors,
        training=scan.training,
        autocast=autocast_state(device.type),
        # buffers made under inference mode cannot be written outside it (and vice versa)
        inference_mode=torch.is_inference_mode_enabled(),
        attn_implementation=attention,
        sampler=sampler,
        pad_id=pad_id,
        mask_form=mask_form,
        windows=tuple(sorted(windows.items())),
        generator_id=None if generator is None else id(generator),
        host_state=scan.host_state,
        prompt_width=prompt_width,
        decode_steps=decode_steps,
        compiled=compiled,
        kv_block_size=kv_block_size,
    )
