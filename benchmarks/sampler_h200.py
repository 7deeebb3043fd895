"""The sampler alone: a decode step's token choice at each truncation, the core's PyTorch math
against the CUDA plugin's fused kernel (and FlashInfer's sampling kernels where it imports).

For each shape (rows x vocabulary: llama-1b at batch 256 and llama-8b at batch 64 by default,
both Llama 3's 128,256 tokens) and each setting of :data:`SETTINGS`, it times
``graphcap.rollout.sampling.select`` as the decode step calls it (float32 scores in, a token
per row out) with the core's math and with ``graphcap_cuda.kernels.sampler``'s kernel, as CUDA
graph replays (``kernels_h200.time_calls``), next to greedy's argmax. It also checks, at full
size on the GPU, that the kernel keeps the core's set and draws the core's keyed tokens
(``agree``, ``same_set``: the share of rows that agree; ``same_set_but_ties``: that differ at
most in values equal to the cut, which the kernel keeps all of and generate's sort some: bf16
logits tie often). FlashInfer's kernels draw from their own random
numbers, so they cannot give the keyed draws; they are timed for scale only.

    python3 benchmarks/sampler_h200.py OUT.json [--shapes 256x128256,64x128256] [--smoke]

``--smoke``: tiny shapes on the CPU under Triton's interpreter (checks the script runs). The
whole step's ratio against greedy is ``profile_decode.py``'s (cases ``...:topp95`` etc., with
``--core-sampler`` for the core's math); this isolates the sampler's part of it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: Each setting's SamplingParams fields (all rows alike; per_row draws: every row keyed).
SETTINGS: dict[str, dict[str, Any]] = {
    "t1": {"temperature": 1.0},
    "topp95": {"top_p": 0.95},
    "topk50": {"top_k": 50},
    "minp05": {"min_p": 0.05},
    "topk50-topp95": {"top_k": 50, "top_p": 0.95},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shapes", default="256x128256,64x128256", help="ROWSxVOCAB,...")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
        args.shapes = "3x1000"
    from graphcap_cuda.kernels.sampler import truncated_draw
    from kernels_h200 import time_calls

    device = torch.device("cpu" if args.smoke else "cuda")
    report: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flashinfer": _flashinfer_version(),
        "timing": "CUDA graph replays of select(), microseconds per call",
        "cases": [],
    }
    start = time.perf_counter()
    for shape in args.shapes.split(","):
        rows, vocab = (int(n) for n in shape.split("x"))
        scores = _scores(rows, vocab, device)
        report["cases"].append(
            _case(scores, "greedy", {}, None, time_calls, args.smoke, truncated_draw)
        )
        for name, setting in SETTINGS.items():
            for draws in ("per_row", "generate"):
                for draw in (None, truncated_draw):
                    report["cases"].append(
                        _case(scores, name, setting, draw, time_calls, args.smoke, draws=draws)
                    )
            report["cases"].extend(_flashinfer(scores, name, setting, time_calls, args.smoke))
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} in {report['elapsed_s']} s")
    return 0


def _scores(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Logit-like float32 scores: bf16 logits of a peaked distribution, as the step's
    ``process_scores`` hands them on."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 2.5
    logits[:, :64] += torch.rand(rows, 64, generator=gen) * 12  # a head of likely tokens
    return logits.to(torch.bfloat16).float().to(device)


def _case(
    scores: torch.Tensor,
    name: str,
    setting: dict[str, Any],
    draw: Callable[..., Any] | None,
    time_calls: Callable[..., dict[str, float]],
    smoke: bool,
    fused: Callable[..., Any] | None = None,
    draws: str = "per_row",
) -> dict[str, Any]:
    """select() at one setting, with the core's math (``draw`` None) or the kernel; greedy
    (``name == "greedy"``) times the step's argmax. ``fused``: the kernel, for greedy's
    agreement check."""
    from graphcap.rollout.sampling import RowSettings, SamplerShape, argmax_rows, select
    from graphcap.rollout.settings.sampling_params import SamplingParams

    rows, vocab = scores.shape
    device = scores.device
    greedy = name == "greedy"
    seed = None if draws == "generate" else 7
    params = SamplingParams(do_sample=not greedy, seed=None if greedy else seed, **setting)
    settings = RowSettings.allocate(rows, vocab, device)
    settings.write([params] * rows, list(range(rows)))
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    generated = torch.tensor([5], device=device)
    shape = SamplerShape().widen([params], fused=draw is not None)
    record: dict[str, Any] = {
        "rows": rows,
        "vocab": vocab,
        "setting": name,
        "draws": draws,
        "sampler": "argmax" if greedy else "fused" if draw is not None else "core",
    }
    if greedy:
        record |= time_calls([lambda: argmax_rows(scores)], smoke)
        if fused is not None:
            tokens, _ = fused(scores, *_columns(settings), finished, generated)
            record["agree"] = (tokens == scores.argmax(-1)).float().mean().item()
        return record
    generator = None if seed is not None else torch.Generator(device=device).manual_seed(1)

    def run() -> Any:
        return select(scores, settings, finished, generated, generator, shape, draw)

    record |= time_calls([run], smoke, generators=[] if generator is None else [generator])
    if draw is not None and seed is not None:  # the keyed draw and the set, against the core
        tokens, cut = draw(scores, *_columns(settings), finished, generated)
        reference = SamplerShape().widen([params])
        expected = select(scores, settings, finished, generated, None, reference).tokens
        from graphcap.rollout.sampling import truncated

        scaled = scores / settings.temperature[:, None]
        kept = truncated(scaled, settings) > -float("inf")
        ours = (scaled >= cut[:, None]) & (scaled > -float("inf"))
        differ = ours != kept
        tied = (scaled == cut[:, None]) | ~differ  # bf16 logits tie often at top-p's cut
        record["agree"] = (tokens == expected).float().mean().item()
        record["same_set"] = (~differ).all(dim=-1).float().mean().item()
        record["same_set_but_ties"] = tied.all(dim=-1).float().mean().item()
    return record


def _columns(settings: Any) -> list[torch.Tensor]:
    s = settings
    return [s.temperature, s.top_k, s.top_p_floor, s.min_p, s.sample, s.seeded, s.key]


def _flashinfer_version() -> str | None:
    try:
        import flashinfer
    except Exception:  # not installed, or built for another torch / CUDA
        return None
    return str(getattr(flashinfer, "__version__", "unknown"))


def _flashinfer(
    scores: torch.Tensor,
    name: str,
    setting: dict[str, Any],
    time_calls: Callable[..., dict[str, float]],
    smoke: bool,
) -> list[dict[str, Any]]:
    """FlashInfer's sorting-free sampling at this setting, where it imports (else nothing):
    softmax and the draw, as a step would call them. Its draws are its own random numbers."""
    if smoke or _flashinfer_version() is None:
        return []
    from flashinfer import sampling

    rows = scores.shape[0]
    top_k = torch.full((rows,), setting.get("top_k", 0), dtype=torch.int32, device=scores.device)
    top_p = torch.full((rows,), setting.get("top_p", 1.0), device=scores.device)
    min_p = torch.full((rows,), setting.get("min_p", 0.0), device=scores.device)
    calls = {
        "t1": lambda: sampling.sampling_from_probs(scores.softmax(-1)),
        "topp95": lambda: sampling.top_p_sampling_from_probs(scores.softmax(-1), top_p),
        "topk50": lambda: sampling.top_k_sampling_from_probs(scores.softmax(-1), top_k),
        "minp05": lambda: sampling.min_p_sampling_from_probs(scores.softmax(-1), min_p),
        "topk50-topp95": lambda: sampling.top_k_top_p_sampling_from_logits(scores, top_k, top_p),
    }
    record: dict[str, Any] = {"rows": rows, "vocab": scores.shape[1], "setting": name}
    record |= {"draws": "flashinfer's", "sampler": "flashinfer"}
    try:
        record |= time_calls([calls[name]], smoke)
    except Exception as exc:  # an API that moved between versions: say so, time the rest
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return [record]


if __name__ == "__main__":
    sys.exit(main())
