"""Preallocated 4-D attention masks for the decode step, one per attention layer type.

transformers passes a 4-D mask through untouched, which skips its own mask construction (host
reads, not graph-safe) but also its per-layer-type masks. So the window of sliding-attention
layers is applied here, and a model whose ``config.layer_types`` mixes types gets a dict keyed by
layer type, which transformers accepts. Layer types that need more than a window (chunked
attention, linear attention) are reported by :func:`unsupported_layer_types` so the engine can
refuse them for graphs.

The truth is one boolean ``valid`` matrix ``(B, L)`` (written, non-pad cache columns); the
model-facing buffers ``(B, 1, 1, L)`` are rendered from it each step in the backend's mask form:
``"additive"`` (model dtype, 0 / dtype-min) or ``"bool"`` (True = attend). The eager loop of a
model with unsupported layer types uses ``"padding"``: the 2-D ``valid`` matrix itself, from
which transformers builds its own per-layer-type masks.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: "padding" hands transformers the 2-D valid-column mask so it builds every layer type's mask
#: itself (host logic: eager only, for layer types a window cannot express).
MASK_FORMS = ("additive", "bool", "padding")


def layer_windows(config: object) -> dict[str, int | None]:
    """Attention window per layer type (``None`` = full attention).

    Configs with ``layer_types`` give one entry per type present; a config with only a
    ``sliding_window`` (Mistral-style) slides on every layer.
    """
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        return {FULL_ATTENTION: int(window) if window else None}
    windows: dict[str, int | None] = {}
    for layer_type in dict.fromkeys(types):
        windows[layer_type] = int(window) if layer_type == SLIDING_ATTENTION and window else None
    return windows


def unsupported_layer_types(config: object) -> list[str]:
    """Layer types a window-or-full mask cannot express (empty when all are supported)."""
    types = getattr(config, "layer_types", None) or ()
    return sorted({t for t in types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})


class MaskBuffers:
    """Valid-column bookkeeping plus the rendered masks the model reads."""

    def __init__(
        self,
        batch_size: int,
        total_len: int,
        dtype: torch.dtype,
        device: torch.device,
        windows: Mapping[str, int | None],
        form: str = "additive",
        as_dict: bool = False,
    ):
        if form not in MASK_FORMS:
            raise ValueError(f"mask form must be one of {MASK_FORMS}, got {form!r}")
        self.form = form
        self.windows = dict(windows)
        self.as_dict = as_dict or len(self.windows) > 1
        self.valid = torch.zeros((batch_size, total_len), dtype=torch.bool, device=device)
        self.columns = torch.arange(total_len, device=device)
        out_dtype = dtype if form == "additive" else torch.bool
        self.outputs = {
            name: torch.zeros((batch_size, 1, 1, total_len), dtype=out_dtype, device=device)
            for name in (self.windows if form != "padding" else ())
        }
        # One preallocated fill value, so rendering allocates no host-built literal per step.
        self._blocked = (
            torch.full((1,), torch.finfo(dtype).min, dtype=dtype, device=device)
            if form == "additive"
            else None
        )

    @classmethod
    def for_model(
        cls,
        config: object,
        batch_size: int,
        total_len: int,
        dtype: torch.dtype,
        device: torch.device,
        windows: Mapping[str, int | None],
        form: str,
    ) -> MaskBuffers:
        """The buffers a model with ``config`` needs: one mask per layer type when the config
        lists layer types, and the 2-D "padding" form (eager only; graphs are refused for such
        models) when some layer type is beyond a window."""
        if unsupported_layer_types(config):
            form = "padding"
        layer_types = bool(getattr(config, "layer_types", None))
        return cls(batch_size, total_len, dtype, device, windows, form=form, as_dict=layer_types)

    def reset(self, prompt_mask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Forget every previous column; mark the prompt's non-pad columns valid.

        With ``rows``, only those rows are reset (a refilled slot on the continuous path).
        """
        width = prompt_mask.shape[-1]
        if rows is None:
            self.valid.zero_()
            self.valid[:, :width].copy_(prompt_mask.bool())
        else:
            fresh = torch.zeros_like(self.valid[rows])
            fresh[:, :width] = prompt_mask.bool()
            self.valid[rows] = fresh

    def leading(self, rows: int) -> MaskBuffers:
        """The first ``rows`` rows' buffers, as views (a step of a smaller batch size)."""
        view = copy.copy(self)
        view.valid = self.valid[:rows]
        view.outputs = {name: out[:rows] for name, out in self.outputs.items()}
        return view

    def row_tensors(self) -> list[torch.Tensor]:
        """The buffers with one row per batch row (what moves with a row)."""
        return [self.valid, *self.outputs.values()]

    def attend(self, columns: torch.Tensor) -> None:
        """Mark column ``columns[b]`` of each row valid (the token being written there)."""
        self.valid.scatter_(1, columns[:, None], True)

    def render(self, query_columns: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """Write the masks for queries at ``query_columns`` (B,) and return what the model takes."""
        if self.form == "padding":
            return self.valid
        batch, length = self.valid.shape
        for name, window in self.windows.items():
            allowed = self.valid
            if window is not None:
                allowed = allowed & (self.columns[None, :] > query_columns[:, None] - window)
            out = self.outputs[name]
            if self._blocked is None:
                out.copy_(allowed.view(batch, 1, 1, length))
            else:
                out.copy_(torch.where(allowed.view(batch, 1, 1, length), 0.0, self._blocked))
        if self.as_dict:
            return dict(self.outputs)
        return next(iter(self.outputs.values()))
