"""A minimal GRPO-style loop: graph-captured rollouts, a policy-gradient step in place, repeat.

    python examples/grpo_loop.py [--iterations 4] [--sleep]

The policy is a small Llama built from a config with random weights (fp32), on the backend
``graphcap.get_backend()`` selects (GRAPHCAP_BACKEND, or the best available: the CPU reference
backend here, a GPU unchanged). Each iteration:

1. rollout: ``n`` samples per left-padded prompt, with ``logprobs_mode="temperature"``
   log-probs (``log_softmax(logits / T)`` over the full vocabulary, what the trainer recomputes);
2. reward: how often a target token appears in the response; advantages normalised per group
   (the ``n`` samples of one prompt);
3. training: the trainer recomputes the log-probs teacher-forced (printed: their largest
   difference from the rollout's, ~1e-5 in fp32), then a clipped policy-gradient step whose
   ratio is ``exp(trainer - rollout)``; ``optimizer.step()`` updates the weights in place, so
   their addresses (in the graph signature) stay and the next rollout replays the graphs
   captured before.

Each graph is one batch size of the live-row ladder (``RolloutConfig.batch_ladder``): as rows
end at EOS a rollout moves its live rows to a smaller size, and the first rollout to reach a
size captures it. So the run captures a few graphs (the sizes printed at the end), each once;
an iteration that prints "captured 1 graph(s)" after the first reached a new size.

Without ``--sleep`` the engine keeps its KV cache and graphs between rollouts. With ``--sleep`` it
calls ``engine.sleep()`` before each training step, handing that memory to the trainer; where the
backend keeps addresses across a release (``keeps_addresses_on_release``: the CPU reference
backend, CUDA with torch_memory_saver) the graphs survive it and the next rollout replays them
after mapping the memory again (printed: "woke in N ms", ``stats.wake_s``); elsewhere each
rollout captures its sizes again. docs/rollout.md, "Memory between rollouts", discusses the
choice.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from graphcap import get_backend
from graphcap.rollout import RolloutConfig, RolloutEngine, RolloutResult, SamplingParams
from graphcap.tiny_models import prompts, tiny_model

VOCAB, PAD, EOS, TARGET = 32, 0, 1, 7
TEMPERATURE = 0.8
CLIP = 0.2


def build_policy(seed: int = 0) -> torch.nn.Module:
    """graphcap's tiny Llama (2 layers, random weights); a large init std keeps its samples
    varied."""
    return tiny_model("llama", vocab_size=VOCAB, seed=seed, max_position_embeddings=128)


def make_prompts(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Left-padded prompts: row ``i`` has ``width - i % 3`` tokens."""
    return prompts(rows, width, vocab_size=VOCAB, seed=1, device=device)


def rewards_of(result: RolloutResult, width: int) -> torch.Tensor:
    """The toy reward: how many response tokens are ``TARGET``."""
    response = result.sequences[:, width:]
    return ((response == TARGET) & result.response_mask).sum(-1).float()


def group_advantages(rewards: torch.Tensor, samples: int) -> torch.Tensor:
    """GRPO's advantage: each reward normalised within its prompt's group of samples."""
    groups = rewards.view(-1, samples)
    normalised = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)
    return normalised.view(-1)


def trainer_logprobs(
    model: torch.nn.Module, result: RolloutResult, prompt_mask: torch.Tensor, samples: int
) -> torch.Tensor:
    """Teacher-forced ``log_softmax(logits / T)`` of each response token, as TRL / verl do."""
    width = prompt_mask.shape[1]
    mask = torch.cat([prompt_mask.repeat_interleave(samples, 0), result.response_mask.long()], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=result.sequences, attention_mask=mask, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, width - 1 : -1].float() / TEMPERATURE, dim=-1)
    return logp.gather(-1, result.sequences[:, width:, None]).squeeze(-1)


def policy_loss(
    new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The clipped surrogate, averaged over each row's response tokens, then over rows."""
    ratio = torch.exp(new - old)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    per_row = (surrogate * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return -per_row.mean()


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="n: samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sleep", action="store_true", help="engine.sleep() while training")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.samples < 2:
        parser.error("--iterations must be >= 1 and --samples >= 2 (a group needs two samples)")

    backend = get_backend()  # GRAPHCAP_BACKEND, or the best available
    model = build_policy().to(backend.device)
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=backend))
    ids, mask = make_prompts(args.prompts, args.prompt_len, backend.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    addresses = [p.data_ptr() for p in model.parameters()]
    print(f"backend {backend.name}, sleep between rollouts: {args.sleep}")

    max_diff, graphs, sizes = 0.0, 0, set()
    for iteration in range(args.iterations):
        sampling = SamplingParams(
            do_sample=True,
            temperature=TEMPERATURE,
            max_new_tokens=args.max_new_tokens,
            num_return_sequences=args.samples,
            return_logprobs=True,
            logprobs_mode="temperature",
            seed=iteration,  # per call: reproducible, the global RNG untouched
        )
        result = engine.generate(ids, mask, sampling)
        stats = result.stats
        # one graph per batch size the call ran: the live-row ladder follows rows that ended
        reached = set(stats.batch_steps) or {stats.batch_size}
        graphs, sizes = graphs + len(reached), sizes | reached
        if args.sleep:
            engine.sleep()  # the K/V cache and the graphs' memory go back to the trainer

        rewards = rewards_of(result, ids.shape[1])
        advantages = group_advantages(rewards, args.samples)
        response_mask = result.response_mask.float()
        model.train()
        new = trainer_logprobs(model, result, mask, args.samples)
        diff = ((new.detach() - result.logprobs).abs() * response_mask).max().item()
        max_diff = max(max_diff, diff)
        loss = policy_loss(new, result.logprobs, advantages, response_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()  # in place: the parameters keep their addresses
        model.eval()
        woke = "" if stats.wake_s is None else f", woke in {stats.wake_s * 1e3:.1f} ms"
        print(
            f"iteration {iteration}: path {stats.path}, batch sizes {sorted(reached)}, "
            f"captured {len(stats.capture_reasons)} graph(s) in {stats.capture_s:.3f} s of "
            f"{stats.total_s:.3f} s{woke}, mean reward {rewards.mean().item():.3f}, "
            f"max |trainer - rollout| log-prob {diff:.2e}, loss {loss.item():+.4f}"
        )

    assert addresses == [p.data_ptr() for p in model.parameters()], "a weight moved"
    # kept across in-place updates and sleeps that keep them: each size once; once a rollout
    # where a sleep drops them
    kept = not args.sleep or backend.capabilities.keeps_addresses_on_release
    expected = len(sizes) if kept else graphs
    captures = engine.captures
    assert captures == expected, f"captured {captures} graphs, expected {expected}"
    each = "once per rollout that reached it" if not kept else "once"
    print(
        f"captures={captures} (expected {expected}): batch sizes {sorted(sizes)}, each captured "
        f"{each}; max log-prob difference {max_diff:.2e}"
    )
    engine.shutdown()
    return {"captures": captures, "max_logprob_diff": max_diff, "path": stats.path}


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - started:.1f} s")
