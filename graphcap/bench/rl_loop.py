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

from graphcap.bench.modes import Workload
from graphcap.bench.report import RLIteration, RLLoopResult
from graphcap.bench.timing import timed_call
from graphcap.rollout import RolloutConfig, RolloutEngine, RolloutResult, SamplingParams


def parameter_addresses(model: nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Address and shape of every parameter: what an in-place update must leave unchanged."""
    return {name: (p.data_ptr(), tuple(p.shape)) for name, p in model.named_parameters()}


def make_optimizer(
    name: str, params: list[nn.Parameter], lr: float, dtype: torch.dtype
) -> torch.optim.Optimizer:
    """SGD or AdamW, both updating the parameter tensors in place (``foreach``, not fused)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        if dtype == torch.float16:
            raise ValueError(
                "AdamW on fp16 weights underflows its epsilon (NaN weights); use "
                "--rl-optimizer sgd or --dtype bf16/fp32"
            )
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose 'sgd' or 'adamw'")


def policy_gradient_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sequences: torch.Tensor,
    prompt_width: int,
    advantages: torch.Tensor,
) -> float:
    """One REINFORCE-style update on the generated tokens; returns the loss.

    ``advantages`` (one per row) weight each row's log-likelihood, so the step pushes some
    rollouts up and others down, as an RL update does, and actually changes what the model
    generates next time.
    """
    model.train()
    try:
        logits = model(input_ids=sequences).logits[:, prompt_width - 1 : -1].float()
        targets = sequences[:, prompt_width:]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        loss = -(advantages[:, None] * logp).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        model.eval()
    return float(loss.detach())


def run_rl_loop(
    work: Workload,
    *,
    iterations: int,
    optimizer: str = "sgd",
    lr: float = 1e-3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[RLLoopResult]:
    """``iterations`` rounds of eager generate, graph generate, training step."""
    say = progress or (lambda _line: None)
    model, backend = work.model, work.backend
    dtype = next(model.parameters()).dtype
    opt = make_optimizer(optimizer, list(model.parameters()), lr, dtype)
    advantages = torch.randn(
        work.batch_size, generator=torch.Generator().manual_seed(seed), dtype=torch.float32
    ).to(backend.device)
    sampling = SamplingParams(
        max_new_tokens=work.new_tokens, do_sample=False, pad_token_id=work.pad_token_id
    )
    engines = {"graphcap-eager": False}
    if backend.supports_graph_capture:
        engines["graphcap-graph"] = True
    results = {
        name: RLLoopResult(mode=name, batch_size=work.batch_size, optimizer=optimizer)
        for name in engines
    }
    running = {
        name: RolloutEngine(model, RolloutConfig(enable_graph_capture=g, backend=backend))
        for name, g in engines.items()
    }
    addresses = parameter_addresses(model)
    previous: torch.Tensor | None = None
    try:
        for it in range(iterations):
            outputs: dict[str, tuple[float, RolloutResult, int | None]] = {}
            for name, engine in running.items():
                backend.reset_peak_memory_stats()
                timed = timed_call(
                    lambda e=engine: e.generate(work.input_ids, work.attention_mask, sampling),
                    backend.synchronize,
                )
                outputs[name] = (timed.seconds, timed.value, backend.max_memory_allocated())
            rollout = outputs[next(reversed(outputs))][1]
            backend.reset_peak_memory_stats()
            train = timed_call(
                lambda r=rollout: policy_gradient_step(
                    model, opt, r.sequences, work.prompt_width, advantages
                ),
                backend.synchronize,
            )
            train_peak = backend.max_memory_allocated()
            eager_tokens = outputs["graphcap-eager"][1].sequences
            for name, (seconds, result, peak) in outputs.items():
                results[name].iterations.append(
                    RLIteration(
                        iteration=it,
                        generate_s=seconds,
                        train_step_s=train.seconds,
                        loss=train.value,
                        captures=result.stats.captures,
                        path=result.stats.path,
                        peak_memory_bytes=peak,
                        train_peak_memory_bytes=train_peak,
                        tokens_match_eager=bool(torch.equal(result.sequences, eager_tokens)),
                        tokens_changed=None
                        if previous is None
                        else not torch.equal(result.sequences, previous),
                    )
                )
            previous = rollout.sequences
            say(
                f"rl-loop iteration {it + 1}/{iterations}: "
                + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, (s, _, _) in outputs.items())
                + f", train step {train.seconds * 1e3:.1f} ms (loss {train.value:.4f})"
            )
    finally:
        for engine in running.values():
            engine.shutdown()
    reallocated = parameter_addresses(model) != addresses
    for name, res in results.items():
        res.parameters_reallocated = reallocated
        res.captures_final = running[name].captures
        _summarise(res)
    return list(results.values())


def _summarise(res: RLLoopResult) -> None:
    its = res.iterations
    if not its:
        return
    res.first_generate_s = its[0].generate_s
    later = [i.generate_s for i in its[1:]]
    res.steady_generate_median_s = statistics.median(later) if later else None
    res.train_step_median_s = statistics.median(i.train_step_s for i in its)
    res.iteration_median_s = statistics.median(i.generate_s + i.train_step_s for i in its)


def rl_warnings(results: list[RLLoopResult]) -> list[str]:
    """What broke the RL-loop invariants: reallocated weights, or a graph captured again."""
    warnings = []
    for res in results:
        if res.parameters_reallocated:
            warnings.append(f"rl-loop {res.mode}: the optimizer reallocated parameters")
        if res.mode == "graphcap-graph" and res.captures_final != 1:
            warnings.append(
                f"rl-loop graphcap-graph captured {res.captures_final} times (expected 1): "
                "the weight updates invalidated the graph"
            )
    return warnings
