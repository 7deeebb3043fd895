"""The RL loop of a trainer, timed: generate with an eager and a graph engine on the same weights,
then a training step that updates the weights in place, N times. A captured graph must see the
new weights without recapturing and match the eager engine on them (in fp32); the script reports
each engine's generate time, the training step's time and peak memory, and warns otherwise.

python benchmarks/rl_loop.py --model llama-1b --batch-size 8 --iterations 3 --json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import graphcap
from graphcap import preset_models
from graphcap.bench import models
from graphcap.bench.modes import MODES, Workload, spread, timed_call
from graphcap.bench.report import render_table


@dataclass
class RLIteration:
    """One generate -> train-step iteration of the RL loop for one engine."""

    iteration: int
    generate_s: float
    train_step_s: float
    loss: float
    captures: int | None
    path: str | None
    peak_memory_bytes: int | None = None
    train_peak_memory_bytes: int | None = None
    tokens_match_eager: bool | None = None
    tokens_changed: bool | None = None


@dataclass
class RLLoopResult:
    """The RL loop for one mode (eager or graph): per-iteration phases and the invariants."""

    mode: str
    batch_size: int
    optimizer: str
    iterations: list[RLIteration] = field(default_factory=list)
    parameters_reallocated: bool = False
    captures_final: int | None = None
    first_generate_s: float | None = None
    steady_generate_median_s: float | None = None
    train_step_median_s: float | None = None
    iteration_median_s: float | None = None


def make_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """SGD or AdamW, both updating the parameter tensors in place (``foreach``, not fused)."""
    if name == "adamw" and any(p.dtype == torch.float16 for p in params):
        raise ValueError(
            "AdamW on fp16 weights underflows its epsilon (NaN weights); use --rl-optimizer sgd "
            "or --dtype bf16/fp32"
        )
    return {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[name](params, lr=lr)


def policy_gradient_step(
    model: nn.Module, opt: torch.optim.Optimizer, seqs: torch.Tensor, prompt: int, adv: torch.Tensor
) -> float:
    """One REINFORCE-style update (log-likelihoods weighted by per-row advantages); the loss."""
    model.train()
    try:
        logits = model(input_ids=seqs).logits[:, prompt - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, prompt:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    finally:
        model.eval()
    return float(loss.detach())


def run_rl_loop(
    work: Workload, *, iterations: int, optimizer: str = "sgd", lr: float = 1e-3, seed: int = 0
) -> tuple[list[RLLoopResult], list[str]]:
    """``iterations`` rounds of eager generate, graph generate, training step; the results and
    :func:`rl_warnings`."""
    model, backend, sync = work.model, work.backend, work.backend.synchronize
    opt = make_optimizer(optimizer, list(model.parameters()), lr)
    adv = torch.randn(work.batch_size, generator=torch.Generator().manual_seed(seed))
    adv = adv.to(backend.device)
    names = ["graphcap-eager", "graphcap-graph"][: 1 + backend.capabilities.graph_capture]
    results = [RLLoopResult(n, work.batch_size, optimizer) for n in names]
    addresses, previous = [(p.data_ptr(), p.shape) for p in model.parameters()], None
    with contextlib.ExitStack() as stack:
        calls = [stack.enter_context(MODES[n].session(work))[0] for n in names]
        for it in range(iterations):
            runs = []
            for call in calls:
                backend.reset_peak_memory_stats()
                runs.append((*timed_call(call, sync), backend.max_memory_allocated()))
            eager, rollout = runs[0][1].tokens, runs[-1][1].tokens  # the graph's, if there is one
            backend.reset_peak_memory_stats()
            seqs = torch.cat([work.input_ids, rollout.to(backend.device)], dim=1)
            step = functools.partial(policy_gradient_step, model, opt, seqs, work.prompt_width, adv)
            train_s, loss = timed_call(step, sync)
            train_peak = backend.max_memory_allocated()
            for res, (seconds, out, peak) in zip(results, runs, strict=True):
                changed = None if previous is None else not torch.equal(out.tokens, previous)
                row = RLIteration(it, seconds, train_s, loss, out.stats.captures, out.stats.path)
                row.peak_memory_bytes, row.train_peak_memory_bytes = peak, train_peak
                row.tokens_match_eager, row.tokens_changed = torch.equal(out.tokens, eager), changed
                res.iterations.append(row)
            previous = rollout
    moved = addresses != [(p.data_ptr(), p.shape) for p in model.parameters()]
    for res in results:
        its, res.parameters_reallocated = res.iterations, moved
        res.captures_final, res.first_generate_s = its[-1].captures, its[0].generate_s
        res.steady_generate_median_s = spread(i.generate_s for i in its[1:])[0]
        res.train_step_median_s = spread(i.train_step_s for i in its)[0]
        res.iteration_median_s = spread(i.generate_s + i.train_step_s for i in its)[0]
    return results, rl_warnings(results)


def rl_warnings(results: list[RLLoopResult]) -> list[str]:
    """What broke the RL-loop invariants: reallocated weights, or a graph captured again."""
    moved = [f"rl-loop {r.mode}: the optimizer reallocated parameters" for r in results]
    return [m for m, r in zip(moved, results, strict=True) if r.parameters_reallocated] + [
        f"rl-loop graphcap-graph captured {r.captures_final} times (expected 1): the weight "
        "updates invalidated the graph"
        for r in results
        if r.mode == "graphcap-graph" and r.captures_final != 1
    ]


#: header -> cell of an iteration's row
COLUMNS = {
    "iter": lambda i: str(i.iteration),
    "generate(ms)": lambda i: f"{i.generate_s * 1e3:.1f}",
    "train(ms)": lambda i: f"{i.train_step_s * 1e3:.1f}",
    "captures": lambda i: str(i.captures),
    "path": lambda i: str(i.path),
    "peak mem": lambda i: (
        "n/a" if i.peak_memory_bytes is None else f"{i.peak_memory_bytes / 2**30:.2f}G"
    ),
    "=eager": lambda i: str(i.tokens_match_eager),
    "changed": lambda i: str(i.tokens_changed),
}


def format_rl_loop(results: list[RLLoopResult]) -> str:
    """Each engine's iterations as a text table, after a line of its medians and invariants."""
    lines = []
    for res in results:
        its = res.iterations
        lines += [
            f"rl-loop {res.mode} (bs {res.batch_size}, {res.optimizer}): captures at end "
            f"{res.captures_final}, parameters reallocated: {res.parameters_reallocated}; "
            f"generate after the first {_ms(i.generate_s for i in its[1:])} ms, train "
            f"step {_ms(i.train_step_s for i in its)} ms",
            *render_table(list(COLUMNS), [[c(i) for c in COLUMNS.values()] for i in its], "  "),
        ]
    return "\n".join(lines)


def _ms(values: Iterable[float]) -> str:
    """``median [min-max]`` in ms."""
    median, least, most = (None if v is None else v * 1e3 for v in spread(values))
    return "n/a" if median is None else f"{median:.1f} [{least:.1f}-{most:.1f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="a preset or a local directory")
    parser.add_argument("--dtype", choices=sorted(preset_models.DTYPES), default=None)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args(argv)
    backend = graphcap.get_backend()
    dtype = args.dtype or preset_models.default_dtype_name(args.model, backend.device.type)
    model = preset_models.build_model(
        args.model, dtype=preset_models.DTYPES[dtype], device=backend.device
    )
    vocab = model.config.vocab_size
    ids, mask = models.make_prompts(
        vocab, args.batch_size, args.prompt_len, args.seed, backend.device
    )
    work = Workload(model, backend, ids, mask, args.new_tokens)
    try:
        results, warnings = run_rl_loop(
            work, iterations=args.iterations, optimizer=args.optimizer, lr=args.lr, seed=args.seed
        )
    except ValueError as exc:
        print(f"rl_loop.py: {exc}", file=sys.stderr)
        return 2
    print(format_rl_loop(results), *(f"warning: {w}" for w in warnings), sep="\n")
    if args.json:
        data = [dataclasses.asdict(r) for r in results]
        Path(args.json).write_text(json.dumps({"results": data, "warnings": warnings}, indent=2))
    return 1 if warnings else 0


if __name__ == "__main__":
    raise SystemExit(main())
