"""Trainer-exact mode on a GPU: its cost, and how far each rollout is from the trainer.

Three parts, each on its own (one that fails is recorded under ``errors`` and the others run):

- ``rollout``: an rl-round-like call (``--prompts`` x ``--samples`` rows, prompts of
  ``--prompt-widths`` tokens left-padded, ``--new`` sampled tokens, EOS off) on the default
  engine (``RolloutConfig()``: compiled graphs, joined projections) and on
  ``RolloutConfig(trainer_exact=True)``: the first call timed alone, then the median of
  ``--repeats`` calls, and their ratio.
- ``trainer``: the trainer's forward and backward of a policy-gradient-shaped loss on a
  ``--train-batch`` x ``--train-len`` batch (a quarter of the rows left-padded), the model's
  default bf16 forward against the same under ``trainer_exact``: first call, median, ratio.
- ``mismatch``: the rollout's recorded temperature-1 log-probs against the trainer's
  recomputation of the same tokens (a full-sequence forward of the same model in batches of
  ``--recompute-rows``, positions counted over real tokens), for HF ``generate``, graphcap's
  default engine, graphcap's uncompiled graphs (against the default forward) and graphcap's
  trainer-exact engine (against the forward under ``trainer_exact``): mean, p99 and max
  |Δlogp| and the share bitwise equal, over every generated token.

    python3 benchmarks/trainer_exact_h200.py OUT.json [--model llama-1b] [--smoke]

``--smoke``: a tiny llama on the CPU reference backend (checks the script runs). Written for
the llama-1b preset in bf16 in about six minutes on an H100 or H200; llama-8b fits with
``--train-batch 8``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import graphcap
from graphcap.preset_models import build_model
from graphcap.rollout import (
    RolloutConfig,
    RolloutEngine,
    SamplingParams,
    token_logprobs,
    trainer_exact,
)
from graphcap.rollout.exact import real_positions

#: The engines compared: (name, RolloutConfig keywords, whether the trainer's side is exact).
ENGINES: dict[str, tuple[dict[str, Any], bool]] = {
    "graphcap_default": ({}, False),
    "graphcap_uncompiled": ({"compile": False}, False),
    "graphcap_trainer_exact": ({"trainer_exact": True}, True),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-widths", default="64,256", help="least,most prompt tokens")
    parser.add_argument("--new", type=int, default=256, help="sampled tokens per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--train-len", type=int, default=512)
    parser.add_argument("--recompute-rows", type=int, default=16)
    parser.add_argument("--parts", default="rollout,trainer,mismatch")
    parser.add_argument("--smoke", action="store_true", help="tiny llama on the CPU")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.prompts, args.samples, args.new = "tiny-llama", 2, 2, 8
        args.prompt_widths, args.repeats, args.train_batch, args.train_len = "4,12", 1, 2, 32
        args.recompute_rows = 2
    backend = graphcap.get_backend("cpu" if args.smoke else None)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = build_model(args.model, dtype=dtype, device=backend.device)
    report: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "device": backend.device_name(),
        "backend": backend.name,
        "torch": torch.__version__,
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "errors": {},
    }
    bench = Bench(model, backend, args)
    start = time.perf_counter()
    for part in args.parts.split(","):
        try:
            report[part] = getattr(bench, part)()
        except Exception as exc:  # recorded; the other parts still run
            report["errors"][part] = (
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
            )
            print(f"{part} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            bench.release()
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "errors"}, indent=1))
    print(f"wrote {args.out} in {report['elapsed_s']} s ({len(report['errors'])} parts failed)")
    return 0


class Bench:
    def __init__(self, model: torch.nn.Module, backend: graphcap.Backend, args: Any) -> None:
        self.model, self.backend, self.args = model, backend, args
        self.engines: dict[str, RolloutEngine] = {}
        least, most = (int(n) for n in args.prompt_widths.split(","))
        vocab = model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(least, most + 1, (args.prompts,), generator=generator)
        width = int(lengths.max())
        self.mask = (torch.arange(width)[None] >= width - lengths[:, None]).long()
        self.ids = torch.randint(3, vocab, (args.prompts, width), generator=generator) * self.mask
        self.ids, self.mask = self.ids.to(backend.device), self.mask.to(backend.device)

    def engine(self, name: str) -> RolloutEngine:
        if name not in self.engines:
            config = RolloutConfig(backend=self.backend, **ENGINES[name][0])
            self.engines[name] = RolloutEngine(self.model, config)
        return self.engines[name]

    def release(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()
        self.engines.clear()
        gc.collect()
        self.backend.empty_cache()

    def sampling(self, logprobs: bool) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.args.new,
            min_new_tokens=self.args.new,
            do_sample=True,
            temperature=1.0,
            seed=1,
            num_return_sequences=self.args.samples,
            return_logprobs=logprobs,
            logprobs_mode="raw",
        )

    def timed(self, call: Callable[[], Any]) -> tuple[float, Any]:
        self.backend.synchronize()
        start = time.perf_counter()
        out = call()
        self.backend.synchronize()
        return time.perf_counter() - start, out

    def series(self, call: Callable[[], Any]) -> dict[str, Any]:
        first, _ = self.timed(call)
        steady = [self.timed(call)[0] for _ in range(self.args.repeats)]
        return {"first_s": round(first, 4), "median_s": round(statistics.median(steady), 4),
                "steady_s": [round(s, 4) for s in steady]}  # fmt: skip

    def rollout(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": self.args.prompts * self.args.samples}
        for name in ("graphcap_default", "graphcap_trainer_exact"):
            engine = self.engine(name)
            out[name] = self.series(
                lambda e=engine: e.generate(self.ids, self.mask, self.sampling(False))
            )
            out[name]["path"] = engine.generate(
                self.ids, self.mask, self.sampling(False)
            ).stats.path
        out["ratio"] = _ratio(out["graphcap_trainer_exact"], out["graphcap_default"])
        return out

    def trainer(self) -> dict[str, Any]:
        batch, length = self.args.train_batch, self.args.train_len
        vocab = self.model.config.vocab_size
        generator = torch.Generator().manual_seed(2)
        ids = torch.randint(3, vocab, (batch, length), generator=generator)
        mask = torch.ones_like(ids)
        for row in range(0, batch, 4):  # a quarter of the rows left-padded
            mask[row, : length // 4] = 0
        ids, mask = (ids * mask).to(self.backend.device), mask.to(self.backend.device)
        self.model.train()
        try:
            out: dict[str, Any] = {"batch": batch, "length": length}
            for name, exact in (("default", False), ("trainer_exact", True)):
                out[name] = self.series(lambda exact=exact: self._step(ids, mask, exact))
            out["ratio"] = _ratio(out["trainer_exact"], out["default"])
        finally:
            self.model.zero_grad(set_to_none=True)
            self.model.eval()
        return out

    def _step(self, ids: torch.Tensor, mask: torch.Tensor, exact: bool) -> None:
        self.model.zero_grad(set_to_none=True)
        with _exact_or_not(self.model, exact):
            logits = self._forward(ids, mask)
            logp = _logprobs(logits[:, :-1], ids[:, 1:], exact)
        (-(logp * mask[:, 1:]).sum() / mask.sum()).backward()

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = real_positions(mask)
        return self.model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits

    def mismatch(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            out["hf_generate"] = self._stats(*self._hf(), exact=False)
        except Exception as exc:  # recorded: the engines still run
            out["hf_generate"] = {"error": f"{type(exc).__name__}: {exc}"}
        for name, (_, exact) in ENGINES.items():
            try:
                result = self.engine(name).generate(self.ids, self.mask, self.sampling(True))
                width = self.ids.shape[1]
                rows = [
                    lp[m.bool()]
                    for lp, m in zip(result.logprobs, result.response_mask, strict=True)
                ]
                out[name] = self._stats(result.sequences, width, rows, exact=exact)
                out[name]["path"] = result.stats.path
            except Exception as exc:  # recorded: the others still run
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                self.release()
        return out

    def _hf(self) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        torch.manual_seed(1)
        with torch.no_grad():
            generated = self.model.generate(
                self.ids,
                attention_mask=self.mask,
                do_sample=True,
                temperature=1.0,
                top_k=None,
                top_p=None,
                max_new_tokens=self.args.new,
                min_new_tokens=self.args.new,
                num_return_sequences=self.args.samples,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        width = self.ids.shape[1]
        new = generated.sequences[:, width:]
        logits = torch.stack(generated.logits, 1)
        del generated.logits
        rows = []
        for start in range(0, logits.shape[0], self.args.recompute_rows):
            part = slice(start, start + self.args.recompute_rows)
            rows += list(_logprobs(logits[part], new[part], exact=False))
        return generated.sequences, width, rows

    def _stats(
        self, sequences: torch.Tensor, width: int, recorded: list[torch.Tensor], exact: bool
    ) -> dict[str, Any]:
        """|Δlogp| between ``recorded`` (each row's response tokens' log-probs) and the
        trainer's recomputation of ``sequences`` (prompt ``width`` columns, left-padded)."""
        prompt_mask = self.mask.repeat_interleave(self.args.samples, 0)
        full = torch.cat([prompt_mask, torch.ones_like(sequences[:, width:])], 1)
        differences = []
        step = self.args.recompute_rows
        for start in range(0, sequences.shape[0], step):
            ids, mask = sequences[start : start + step], full[start : start + step]
            with torch.no_grad(), _exact_or_not(self.model, exact):
                logits = self._forward(ids, mask)
                logp = _logprobs(logits[:, width - 1 : -1], ids[:, width:], exact)
            for row, mine in zip(logp, recorded[start : start + step], strict=True):
                differences.append((row[: mine.shape[0]] - mine).abs().float().flatten())
            del logits
        delta = torch.cat(differences).cpu()
        return {
            "tokens": delta.numel(),
            "mean_abs": delta.mean().item(),
            "p99_abs": delta.quantile(0.99).item() if delta.numel() < 2**24 else None,
            "max_abs": delta.max().item(),
            "bitwise_equal_share": (delta == 0).float().mean().item(),
        }


def _exact_or_not(model: torch.nn.Module, exact: bool) -> Any:
    return trainer_exact(model) if exact else contextlib.nullcontext()


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, exact: bool) -> torch.Tensor:
    """The trainer's per-token log-probs: the exact side's :func:`token_logprobs`, else a plain
    float32 ``log_softmax`` (what a trainer does by default)."""
    if exact:
        return token_logprobs(logits, tokens)
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)


def _ratio(exact: dict[str, Any], default: dict[str, Any]) -> float:
    return round(exact["median_s"] / default["median_s"], 3)


if __name__ == "__main__":
    sys.exit(main())
