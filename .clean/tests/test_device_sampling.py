"""Per-row sampling on a real accelerator (``GRAPHCAP_BACKEND=cuda``): mixed settings in one
batch replay one capture and equal each row run alone; log-prob modes match a teacher-forced
recomputation. Skipped unless an accelerator backend is selected."""

from __future__ import annotations

import pytest
from rollout_models import tiny_model
from test_device_rollout import backend, on_device  # noqa: F401  (the fixture)
from test_rollout_sampling import (
    check_logprob_modes_match_recomputation,
    check_mixed_batch_matches_rows_alone,
)

pytestmark = pytest.mark.device


def test_mixed_settings_one_capture_on_device(backend):  # noqa: F811
    model = on_device(tiny_model("llama", fresh=True), backend)
    check_mixed_batch_matches_rows_alone(model, backend)


def test_logprob_modes_match_recomputation_on_device(backend):  # noqa: F811
    model = on_device(tiny_model("llama", fresh=True), backend)
    check_logprob_modes_match_recomputation(model, backend, atol=1e-3)
