"""bf16 decode attentions against a float32 reference: teacher-forced logits of the model's
SDPA, the grouped-query SDPA (``graphcap_gqa_sdpa``) and the split-KV kernel
(``graphcap_split_kv``), each in bf16, against the same random weights run in float32 with
SDPA. Says whether an attention that differs from bf16 SDPA is less accurate or only rounds
differently. The last row, ``split_kv+compile+fuse``, runs the split-KV kernel with the speed
options' kernels too (the compiled blocks of ``compile=True``, the joined products of
``fuse_projections`` and, at batch 1, the CUDA plugin's one-row products), and also gives its
largest difference from the plain split-KV row. One JSON.

    python3 benchmarks/logits_vs_fp32.py OUT.json [--models llama-1b,llama-8b] [--batch 1]

Inputs: batch 8 (or ``--batch``) with left padding, 128-token prompts, then 32 single-token
decodes with the engine's 4-D additive mask; the decode steps are compared.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from graphcap_cuda.attention import IMPLEMENTATIONS, SPLIT_KV, register_attention
from graphcap_cuda.backend import CUDABackend

from graphcap.rollout.plan.fusion import ProjectionFusion
from graphcap.rollout.plan.regions import compiled_regions, one_row_products
from graphcap.rollout.plan.scan import scan_model

#: (label, attention implementation): the model's own SDPA, then the plugin's.
ATTENTIONS = (
    ("sdpa", None),
    ("gqa_sdpa", "graphcap_gqa_sdpa"),
    ("split_kv", "graphcap_split_kv"),
)


def build(name: str) -> torch.nn.Module:
    """The preset with seeded random weights in bf16 on the GPU, the model's SDPA."""
    from transformers import AutoModelForCausalLM

    from graphcap.preset_models import preset_config

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            preset_config(name), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def teacher_forced(model, attention: str, ids, mask, follow) -> torch.Tensor:
    """Logits of the prefill's last position, then of each token of ``follow`` fed one at a
    time with the engine's 4-D additive mask, under ``attention``."""
    from transformers import DynamicCache

    own = model.config._attn_implementation
    model.set_attn_implementation(attention)
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache
            )
            logits = [out.logits[:, -1].float()]
            valid, position = mask.bool(), positions[:, -1:] + 1
            low = torch.finfo(model.dtype).min
            for t in range(follow.shape[1]):
                valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=-1)
                additive = torch.where(valid, 0.0, low).to(model.dtype)[:, None, None, :]
                out = model(
                    input_ids=follow[:, t : t + 1],
                    attention_mask=additive,
                    position_ids=position,
                    past_key_values=cache,
                )
                logits.append(out.logits[:, -1].float())
                position = position + 1
    finally:
        model.set_attn_implementation(own)
    return torch.stack(logits, dim=1)


def compare(name: str, batch: int = 8, prompt: int = 128, steps: int = 32) -> list[dict]:
    model = build(name)
    gen = torch.Generator(device="cuda").manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, prompt), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : 7 * row] = 0
    follow = torch.randint(3, vocab, (batch, steps), device="cuda", generator=gen)
    reference_model = copy.deepcopy(model).float()
    reference = teacher_forced(reference_model, "sdpa", ids, mask, follow)
    del reference_model
    torch.cuda.empty_cache()
    rows, outputs = [], {}
    for label, choice in (*ATTENTIONS, ("split_kv+compile+fuse", SPLIT_KV)):
        if label.endswith("+fuse"):
            with fast_kernels(model):
                got = teacher_forced(model, choice, ids, mask, follow)
            plain = (got - outputs["split_kv"]).abs()[:, 1:]
        else:
            got = outputs[label] = teacher_forced(model, choice or "sdpa", ids, mask, follow)
        diff = (got - reference).abs()[:, 1:]  # decode steps
        rows.append(
            {
                "model": name,
                "attention": label,
                "decode_max_abs_diff_vs_fp32": diff.max().item(),
                "decode_mean_abs_diff_vs_fp32": diff.mean().item(),
                "argmax_agreement_with_fp32": (got.argmax(-1) == reference.argmax(-1))[:, 1:]
                .float()
                .mean()
                .item(),
                "logits_max_abs": reference.abs().max().item(),
            }
        )
        if label.endswith("+fuse"):
            rows[-1]["decode_max_abs_diff_vs_split_kv"] = plain.max().item()
        print(rows[-1], flush=True)
    return rows


@contextlib.contextmanager
def fast_kernels(model: torch.nn.Module) -> Iterator[None]:
    """The model with ``compile=True``'s compiled blocks and one-row products (batch 1) and
    ``fuse_projections``' joined products, as the engine applies them in a capture (the cache
    here is transformers')."""
    fusion = ProjectionFusion(model)
    fusion.join(scan_model(model))
    product = CUDABackend().one_row_product()
    with fusion.applied(), compiled_regions(model), one_row_products(model, product, fusion):
        yield


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--models", default="llama-1b,llama-8b")
    parser.add_argument("--batch", type=int, default=8, help="1: the one-row products serve")
    args = parser.parse_args()
    for implementation in IMPLEMENTATIONS:
        register_attention(implementation)
    report = {"command": " ".join(["python3", *sys.argv]), "device": torch.cuda.get_device_name()}
    report["rows"] = []
    for name in args.models.split(","):
        report["rows"] += compare(name, batch=args.batch)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
