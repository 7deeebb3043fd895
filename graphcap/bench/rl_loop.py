"""The RL loop (generate, then a training step updating the weights in place): a captured graph
must see the new weights without recapturing, and match an eager engine on the same weights."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from graphcap.bench.modes import MODES, Workload, spread, timed_call
from graphcap.bench.report import RLIteration, RLLoopResult


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
        calls = [stack.enter_context(MODES[n].session(work)) for n in names]
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
