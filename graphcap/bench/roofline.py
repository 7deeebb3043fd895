"""Memory-bandwidth roofline for decode: how close a step comes to streaming the weights once.

A decode step at small batch is bound by reading every weight from device memory once, so
``weight bytes / step time`` against the device's peak bandwidth says how much of the hardware
a mode leaves on the table (launch overhead shows up here as a low fraction).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from graphcap.backend import Backend

#: Peak memory bandwidth in bytes/s by device-name fragment (vendor datasheets). Matched in order,
#: case-insensitively, against the name the device reports; the first fragment found wins.
PEAK_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
)


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads.

    Every parameter is read once, except lookup tables (``nn.Embedding``) that are not also the
    output projection: a step gathers only a few of their rows. A tied input/output embedding is
    read in full by the output projection and counted once.
    """
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output_weight = getattr(output, "weight", None)
    gathered = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, nn.Embedding) and m.weight is not output_weight
    }
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in gathered)


def device_name(backend: Backend) -> str:
    """The name the device reports (e.g. "NVIDIA H200"), or the device type on the host."""
    if backend.device.type == "cpu":
        return "cpu"
    get_name = getattr(backend.device_module, "get_device_name", None)
    if get_name is None:
        return backend.device.type
    try:
        return str(get_name(backend.device))
    except Exception:  # a device module may not take a device argument; the name is cosmetic
        return backend.device.type


def peak_bandwidth(name: str, override: float | None = None) -> float | None:
    """Peak bytes/s for ``name``: the override, else the table, else None.

    The table holds accelerators only; on a CPU the roofline appears when the user gives the
    machine's memory bandwidth.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"--peak-bandwidth must be positive (bytes/s), got {override}")
        return override
    lowered = name.lower()
    for fragment, value in PEAK_BANDWIDTH:
        if fragment.lower() in lowered:
            return value
    return None


def bandwidth_figures(
    weight_bytes: int, step_s: float | None, peak: float | None
) -> dict[str, Any]:
    """Achieved weight bandwidth and its fraction of peak (None where either is unknown)."""
    if step_s is None or step_s <= 0:
        return {"weight_bandwidth_gbps": None, "bandwidth_fraction": None}
    achieved = weight_bytes / step_s
    return {
        "weight_bandwidth_gbps": achieved / 1e9,
        "bandwidth_fraction": None if peak is None else achieved / peak,
    }


def parse_bandwidth(text: str) -> float:
    """Parse "4.8TB/s", "4800GB/s", "4.8e12" into bytes/s."""
    cleaned = text.strip().lower().removesuffix("/s").removesuffix("b")
    scale = {"t": 1e12, "g": 1e9, "m": 1e6}.get(cleaned[-1:], 1.0)
    number = cleaned[:-1] if scale != 1.0 else cleaned
    try:
        return float(number) * scale
    except ValueError:
        raise ValueError(
            f"cannot read bandwidth {text!r}; write e.g. 4.8TB/s, 3350GB/s or 4.8e12"
        ) from None
