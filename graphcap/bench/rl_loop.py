"""The RL loop: generate -> one training step that updates the weights in place -> generate.

This is the case graphs must survive in RL: the optimizer writes new values into the same
parameter tensors, so a captured graph keeps its addresses and must see the new weights without
recapturing. Each iteration generates with an eager engine and a graph engine on the *same*
weights (their tokens must match), then takes one policy-gradient-style step on the graph's
rollout. Reported per iteration: each phase's time, capture count (must stay 1), memory, and
whether parameters were reallocated.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch import nn

from graphcap.bench.modes import Workload, timed_call
from graphcap.bench.report import RLIteration, RLLoopResult
from graphcap.rollout import RolloutConfig, RolloutEngine


def make_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """SGD or AdamW, both updating the parameter tensors in place (``foreach``, not fused)."""
    if name == "adamw" and any(p.dtype == torch.float16 for p in params):
        raise ValueError(
            "AdamW on fp16 weights underflows its epsilon (NaN weights); use "
            "--rl-optimizer sgd or --dtype bf16/fp32"
        )
    if name not in ("sgd", "adamw"):
        raise ValueError(f"unknown optimizer {name!r}; choose 'sgd' or 'adamw'")
    return (torch.optim.SGD if name == "sgd" else torch.optim.AdamW)(params, lr=lr)


def policy_gradient_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sequences: torch.Tensor,
    prompt: int,
    advantages: torch.Tensor,
) -> float:
    """One REINFORCE-style update on the generated tokens (each row's log-likelihood weighted by
    its advantage, so some rollouts go up and others down); returns the loss."""
    model.train()
    try:
        logits = model(input_ids=sequences).logits[:, prompt - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, sequences[:, prompt:, None])
        loss = -(advantages[:, None] * logp.squeeze(-1)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        model.eval()
    return float(loss.detach())


def run_rl_loop(
    work: Workload, *, iterations: int, optimizer: str = "sgd", lr: float = 1e-3, seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[RLLoopResult]:  # fmt: skip
    """``iterations`` rounds of eager generate, graph generate, training step."""
    model, backend, sync = work.model, work.backend, work.backend.synchronize
    opt = make_optimizer(optimizer, list(model.parameters()), lr)
    advantages = torch.randn(work.batch_size, generator=torch.Generator().manual_seed(seed))
    advantages = advantages.to(backend.device)
    graphs = {"graphcap-eager": False, "graphcap-graph": True}
    if not backend.supports_graph_capture:
        del graphs["graphcap-graph"]
    engines = {
        n: RolloutEngine(model, RolloutConfig(enable_graph_capture=g, backend=backend))
        for n, g in graphs.items()
    }
    results = {n: RLLoopResult(n, work.batch_size, optimizer) for n in engines}
    addresses = [(p.data_ptr(), p.shape) for p in model.parameters()]
    previous = None
    try:
        for it in range(iterations):
            generated = {}
            for name, engine in engines.items():
                backend.reset_peak_memory_stats()
                seconds, out = timed_call(
                    lambda e=engine: e.generate(
                        work.input_ids, work.attention_mask, work.sampling()
                    ),
                    sync,
                )
                generated[name] = (seconds, out, backend.max_memory_allocated())
            rollout = out.sequences  # the graph engine's (the last) when it ran
            backend.reset_peak_memory_stats()
            train_s, loss = timed_call(
                lambda r=rollout: policy_gradient_step(
                    model, opt, r, work.prompt_width, advantages
                ),
                sync,
            )
            train_peak = backend.max_memory_allocated()
            eager = generated["graphcap-eager"][1].sequences
            for name, (seconds, out, peak) in generated.items():
                results[name].iterations.append(RLIteration(
                    it, seconds, train_s, loss, out.stats.captures, out.stats.path, peak, train_peak,
                    tokens_match_eager=torch.equal(out.sequences, eager),
                    tokens_changed=None if previous is None else not torch.equal(out.sequences, previous),
                ))  # fmt: skip
            previous = rollout
            if progress is not None:
                times = ", ".join(f"{n} {g[0] * 1e3:.1f} ms" for n, g in generated.items())
                progress(
                    f"rl-loop iteration {it + 1}/{iterations}: {times}, train step {train_s * 1e3:.1f} ms (loss {loss:.4f})"
                )
    finally:
        for engine in engines.values():
            engine.shutdown()
    reallocated = addresses != [(p.data_ptr(), p.shape) for p in model.parameters()]
    for res in results.values():
        its, res.parameters_reallocated = res.iterations, reallocated
        res.captures_final, res.first_generate_s = its[-1].captures, its[0].generate_s
        res.steady_generate_median_s = (
            statistics.median(i.generate_s for i in its[1:]) if its[1:] else None
        )
        res.train_step_median_s = statistics.median(i.train_step_s for i in its)
        res.iteration_median_s = statistics.median(i.generate_s + i.train_step_s for i in its)
    return list(results.values())


def rl_warnings(results: list[RLLoopResult]) -> list[str]:
    """What broke the RL-loop invariants: reallocated weights, or a graph captured again."""
    warnings = [
        f"rl-loop {r.mode}: the optimizer reallocated parameters"
        for r in results
        if r.parameters_reallocated
    ]
    return warnings + [
        f"rl-loop graphcap-graph captured {r.captures_final} times (expected 1): the weight updates invalidated the graph"
        for r in results
        if r.mode == "graphcap-graph" and r.captures_final != 1
    ]
