"""The trainers' vocabulary (issue 33): vLLM-shaped and verl-shaped rollout code against the
public API. Each item either works (graph == eager, and == ``generate`` where the math allows)
or is refused with a message that says what to do.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_models import (
    EOS,
    PAD,
    VOCAB,
    generate_padded,
    make_engine,
    prompts,
    teacher_forced_logits,
    tiny_model,
)
from transformers import GenerationConfig

from graphcap.rollout import SamplingParams
from graphcap.rollout.settings.sampling_params import override
from graphcap.rollout.settings.vocabulary import GENERATION_CONFIG_FIELDS

NEW = 8
NO_EOS = {"eos_token_id": []}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def word_tokenizer():
    """A real fast tokenizer over the tiny models' vocabulary: id ``i`` is the word ``t{i}``
    (0 ``<pad>``, 1 ``<eos>``, 2 ``abcdef``, which transformers' stop-string matcher needs),
    each word its own token, decoded by concatenation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(3, VOCAB)} | {"<pad>": PAD, "<eos>": EOS, "abcdef": 2}
    core = Tokenizer(models.WordLevel(vocab, unk_token="abcdef"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"t\d+|abcdef"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def free_run(model, ids, mask, **sampling):
    engine = make_engine(model, graph=False)
    return engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS, **sampling))


# ---- constructor semantics ---------------------------------------------------------------------
def test_warpers_without_do_sample_are_refused_naming_both_ways():
    for kwargs in ({"temperature": 0.9, "top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}):
        with pytest.raises(ValueError, match=r"do_sample=True.*SamplingParams\.from_vllm"):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="from_vllm"):
        SamplingParams(do_sample=True, top_k=-1)
    # explicit either way is unambiguous; temperature 0 is greedy in both vocabularies
    assert SamplingParams(do_sample=True, temperature=0.9, top_p=0.9).do_sample
    assert not SamplingParams(do_sample=False, temperature=0.9).do_sample
    assert not SamplingParams(temperature=0.0).do_sample
    assert SamplingParams(False, 0.9).temperature == 0.9  # positional do_sample is explicit


def test_from_vllm_follows_vllm_meaning():
    sampled = SamplingParams.from_vllm(temperature=0.9, top_p=0.9, top_k=-1, n=4, max_tokens=5)
    assert sampled.do_sample and sampled.top_k is None and sampled.top_p == 0.9
    assert (sampled.num_return_sequences, sampled.max_new_tokens) == (4, 5)
    greedy = SamplingParams.from_vllm(temperature=0.0, presence_penalty=0.0, frequency_penalty=0)
    assert not greedy.do_sample
    assert SamplingParams.from_vllm(seed=3, logprobs=0).return_logprobs
    assert SamplingParams.from_vllm(ignore_eos=True, stop_token_ids=[4]).stop_ids == (4,)
    with pytest.raises(TypeError, match="ignore_eos"):  # the constructor takes its own names
        SamplingParams(ignore_eos=True)
    tok = word_tokenizer()
    stops = SamplingParams.from_vllm(stop=["t5t6", "t9"], tokenizer=tok, stop_token_ids=[7])
    assert stops.stop_sequences == ((5, 6), (9,)) and stops.stop_token_ids == (7,)
    assert SamplingParams.from_vllm(stop="t5", tokenizer=tok).stop_sequences == ((5,),)
    with pytest.raises(ValueError, match="tokenizer="):
        SamplingParams.from_vllm(stop=["</answer>"])


def test_vllm_names_without_a_counterpart_are_refused_saying_what_to_do():
    assert SamplingParams(presence_penalty=0.0, frequency_penalty=0.0) == SamplingParams()
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ValueError, match=rf"{name} must be in \[-2, 2\]"):
            SamplingParams(**{name: 2.5})
    with pytest.raises(ValueError, match="pick on the host"):
        SamplingParams.from_vllm(best_of=2)
    with pytest.raises(ValueError, match=r"logprobs=k\) must be in \[0, 20\]"):
        SamplingParams.from_vllm(logprobs=25)
    with pytest.raises(ValueError, match=r"forward of the model over result\.sequences"):
        SamplingParams.from_vllm(prompt_logprobs=1)
    # generate()'s keyword overrides take vLLM's names too
    with pytest.raises(ValueError, match=r"from_vllm\(stop=\[\.\.\.\], tokenizer=tok\)"):
        override(SamplingParams(), {"stop": ["</answer>"]})
    with pytest.raises(ValueError, match=r"eos_token_id=\[\]"):
        override(SamplingParams(), {"ignore_eos": True})
    with pytest.raises(ValueError, match="token-id lists"):
        SamplingParams(stop_sequences=["</answer>"])
    with pytest.raises(ValueError, match="token-id lists"):
        SamplingParams(stop_sequences=[[]])


def test_vllm_names_at_values_that_ask_for_nothing_are_accepted():
    neutral = {
        "logit_bias": None,
        "best_of": None,
        "detokenize": False,
        "skip_special_tokens": True,
        "bad_words": [],
        "ignore_eos": False,
        "stop": None,
        "prompt_logprobs": None,
    }
    plain = SamplingParams.from_vllm(temperature=0.5, seed=1)
    assert SamplingParams.from_vllm(temperature=0.5, seed=1, **neutral) == plain
    assert override(SamplingParams(), neutral) == SamplingParams()
    for name, value in {"logit_bias": {3: 1.0}, "best_of": 2, "detokenize": True}.items():
        with pytest.raises(ValueError, match=name):
            SamplingParams.from_vllm(**{name: value})
    with pytest.raises(ValueError, match=r"max_tokens=None \(vLLM: up to the model's context\)"):
        SamplingParams.from_vllm(max_tokens=None)


def test_a_vllm_seed_is_its_requests_own_at_any_batch_position():
    """vLLM's per-request seed: the same prompt with the same seed samples the same tokens
    alone, at another batch position and beside other prompts; its n samples differ."""
    model = tiny_model("llama")
    ids, mask = prompts(3, padded=False, seed=4)
    ids[2] = ids[0]
    engine = make_engine(model, graph=True)
    vllm = SamplingParams.from_vllm(temperature=1.0, seed=7, max_tokens=NEW, **NO_EOS)
    batch = engine.generate(ids, mask, vllm).sequences
    assert torch.equal(batch[0], batch[2])
    for row in (0, 1):
        alone = engine.generate(ids[row : row + 1], mask[row : row + 1], vllm).sequences
        assert torch.equal(alone[0], batch[row])
    reordered = engine.generate(ids.flip(0), mask.flip(0), vllm).sequences
    assert torch.equal(reordered.flip(0), batch)
    two = engine.generate(ids[:1], mask[:1], replace(vllm, num_return_sequences=2)).sequences
    assert torch.equal(two[0], batch[0]) and not torch.equal(two[0], two[1])
    # the engine's own call-level seed: prompt row i draws from seed + i
    own = replace(vllm, per_request_seed=False)
    rows = engine.generate(ids, mask, own).sequences
    assert torch.equal(rows[0], batch[0]) and not torch.equal(rows[2], batch[2])
    shifted = engine.generate(ids[2:], mask[2:], replace(vllm, seed=9)).sequences
    assert torch.equal(shifted[0], rows[2])
    engine.shutdown()


def test_n_above_one_with_greedy_rows_is_refused_saying_what_to_do():
    model = tiny_model("gpt2")
    ids, mask = prompts(2)
    engine = make_engine(model, graph=False)
    rows = [
        SamplingParams(do_sample=True, num_return_sequences=2, max_new_tokens=4),
        SamplingParams(max_new_tokens=4),
    ]
    with pytest.raises(ValueError, match="two generate calls"):
        engine.generate(ids, mask, rows)
    with pytest.raises(ValueError, match=r"do_sample=True \(SamplingParams\.from_vllm"):
        SamplingParams(num_return_sequences=2)


# ---- engine signatures -------------------------------------------------------------------------
def test_sleep_and_wake_up_take_vllm_signatures():
    model = tiny_model("llama")
    ids, mask = prompts(2)
    engine = make_engine(model)
    params = SamplingParams(max_new_tokens=4)
    first = engine.generate(ids, mask, params)
    for level in (1, 2):
        engine.sleep(level=level)
        assert engine.sleeping
        engine.wake_up(tags=["weights"])  # the caller's weights: nothing to map
        assert engine.sleeping
        engine.wake_up(tags=["kv_cache"])
        assert not engine.sleeping
        engine.wake_up()
        again = engine.generate(ids, mask, params)
        assert torch.equal(again.sequences, first.sequences) and not again.stats.captured
    with pytest.raises(ValueError, match="1 or 2"):
        engine.sleep(level=3)
    with pytest.raises(ValueError, match="weights"):
        engine.wake_up(tags=["optimizer"])
    with pytest.raises(ValueError, match="a list of"):
        engine.wake_up(tags="weights")


def test_generate_takes_sampling_params_and_keyword_overrides():
    model = tiny_model("qwen2")
    ids, mask = prompts(3)
    engine = make_engine(model)
    reference = engine.generate(ids, mask, SamplingParams(max_new_tokens=5))
    by_keyword = engine.generate(ids, mask, max_new_tokens=5)
    by_alias = engine.generate(ids, mask, sampling_params=SamplingParams(), max_tokens=5)
    for result in (by_keyword, by_alias):
        assert torch.equal(result.sequences, reference.sequences)
        assert result.stats.path == "static_graph"
    sampled = SamplingParams(do_sample=True, seed=4, max_new_tokens=4)
    warmer = engine.generate(ids, mask, sampled, temperature=0.5)
    expected = engine.generate(ids, mask, SamplingParams(**{**vars(sampled), "temperature": 0.5}))
    assert torch.equal(warmer.sequences, expected.sequences)
    with pytest.raises(TypeError, match="not both"):
        engine.generate(ids, mask, SamplingParams(), sampling_params=SamplingParams())
    with pytest.raises(TypeError, match="num_beams"):
        engine.generate(ids, mask, num_beams=2)
    with pytest.raises(ValueError, match="do_sample=True"):
        engine.generate(ids, mask, temperature=0.7)  # the model's config decodes greedily
    assert engine.generate(ids, mask, temperature=0.7, do_sample=True, seed=1).stats.steps


def test_generation_config_without_max_new_tokens_defaults_to_16_like_generate_without_sampling():
    model = tiny_model("gpt2")
    assert model.generation_config.max_new_tokens is None
    params = SamplingParams.from_generation_config(model.generation_config)
    assert params.max_new_tokens == 16
    ids, mask = prompts(2)
    engine = make_engine(model, graph=False)
    implicit = engine.generate(ids, mask)
    explicit = engine.generate(ids, mask, model.generation_config)
    assert implicit.response_mask.shape[1] == explicit.response_mask.shape[1] == 16
    assert torch.equal(implicit.sequences, explicit.sequences)


# ---- ragged prompts ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_ragged_prompts_equal_the_left_padded_tensor_and_return_responses(family):
    model = tiny_model(family)
    ids, mask = prompts(3)
    ragged = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    assert len({len(r) for r in ragged}) > 1
    engine = make_engine(model)
    params = SamplingParams(max_new_tokens=NEW)
    padded = engine.generate(ids, mask, params)
    listed = engine.generate(ragged, None, params)
    assert listed.stats.captures == 1 and listed.stats.path == "static_graph"
    assert torch.equal(listed.sequences, padded.sequences)
    width = ids.shape[1]
    assert torch.equal(listed.responses, padded.sequences[:, width:])
    assert listed.response_bool_mask.dtype == torch.bool
    assert torch.equal(listed.response_bool_mask, padded.response_mask.bool())
    eager = make_engine(model, graph=False).generate(ragged, sampling=params)
    assert torch.equal(eager.sequences, listed.sequences)
    with pytest.raises(ValueError, match="attention_mask=None"):
        engine.generate(ragged, mask, params)
    with pytest.raises(ValueError, match="ragged prompt 1"):
        engine.generate([[5, 6], []], sampling=params)
    with pytest.raises(ValueError, match="ragged prompt 0"):
        engine.generate(["hello"], sampling=params)
    arrays = [np.asarray(row) for row in ragged]  # a tokenizer's return_tensors="np" rows
    assert torch.equal(engine.generate(arrays, sampling=params).sequences, padded.sequences)
    numbers = [[np.int64(t) for t in row] for row in ragged]
    assert torch.equal(engine.generate(numbers, sampling=params).sequences, padded.sequences)


# ---- stop sequences ----------------------------------------------------------------------------
def stop_plan(model, ids, mask):
    """Stop sequences taken from an unstopped run: row 0's tokens 3-4, row 1's token 2 (so both
    end early), and one that never occurs; plus the unstopped run."""
    width = ids.shape[1]
    free = free_run(model, ids, mask)
    row0 = tuple(free.sequences[0, width + 3 : width + 5].tolist())
    row1 = (int(free.sequences[1, width + 2]),)
    return [row0, row1, (VOCAB - 1, VOCAB - 1, VOCAB - 1)], free


def expected_rows(free, width: int, sequences, keep: bool, min_new: int = 0):
    """Each row as the unstopped run truncated at its first stop-sequence match (matches over
    generated tokens only, ending at or after token ``min_new``), with or without the match."""
    rows = []
    for row in free.sequences[:, width:].tolist():
        out, cut = list(row), None
        for end in range(max(min_new, 1), len(row) + 1):
            for seq in sequences:
                if end >= len(seq) and tuple(row[end - len(seq) : end]) == seq:
                    cut = (end, end if keep else end - len(seq))
                    break
            if cut:
                break
        if cut:
            out = row[: cut[1]] + [PAD] * (len(row) - cut[1])
        rows.append(out)
    return torch.tensor(rows)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "opt", "mistral"])
@pytest.mark.parametrize("keep", [True, False])
def test_stop_sequences_graph_equals_eager_and_truncates_at_the_first_match(family, keep):
    model = tiny_model(family)
    ids, mask = prompts(4, seed=5)
    width = ids.shape[1]
    sequences, free = stop_plan(model, ids, mask)
    params = SamplingParams(
        max_new_tokens=NEW,
        stop_sequences=sequences,
        include_stop_str_in_output=keep,
        return_logprobs=True,
        **NO_EOS,
    )
    graph = make_engine(model).generate(ids, mask, params)
    eager = make_engine(model, graph=False).generate(ids, mask, params)
    assert graph.stats.path == "static_graph" and eager.stats.path == "eager"
    for name in ("sequences", "response_mask", "logprobs"):
        assert torch.equal(getattr(graph, name), getattr(eager, name)), name
    assert graph.finish_reasons == eager.finish_reasons
    assert graph.stop_sequences == eager.stop_sequences
    expected = expected_rows(free, width, sequences, keep)
    assert torch.equal(graph.responses, expected)
    assert graph.finish_reasons[:2] == ["stop", "stop"]
    assert graph.stop_sequences[0] in sequences and graph.stop_token_ids[:2] == [None, None]
    lengths = (expected != PAD).sum(-1)
    assert torch.equal(graph.response_lengths, lengths)
    assert not graph.logprobs[~graph.response_bool_mask].any()  # dropped tokens: no log-prob


def test_stop_sequences_honour_min_new_tokens_skip_the_prompt_and_reuse_the_graph():
    model = tiny_model("llama")
    ids, mask = prompts(4, seed=5)
    width = ids.shape[1]
    sequences, free = stop_plan(model, ids, mask)
    engine = make_engine(model, batch_ladder=None)  # one graph: no smaller sizes
    base = {"max_new_tokens": NEW, **NO_EOS}
    pinned = engine.generate(
        ids, mask, SamplingParams(stop_sequences=sequences, min_new_tokens=5, **base)
    )
    first = engine.generate(ids, mask, SamplingParams(stop_sequences=sequences, **base))
    assert torch.equal(first.responses, expected_rows(free, width, sequences, keep=False))
    expected = expected_rows(free, width, sequences, keep=False, min_new=5)
    assert torch.equal(pinned.responses, expected)
    # the prompt's last token followed by the first generated one is not a match
    straddling = [(int(ids[0, -1]), int(free.sequences[0, width]))]
    across = engine.generate(ids, mask, SamplingParams(stop_sequences=straddling, **base))
    assert torch.equal(across.responses, expected_rows(free, width, straddling, keep=False))
    # another list of at most the same shape is written into the held table: no recapture
    assert first.stats.captures == pinned.stats.captures == across.stats.captures == 1
    longer = engine.generate(ids, mask, SamplingParams(stop_sequences=[(5,) * 6], **base))
    assert longer.stats.captures == 2 and "sampler" in longer.stats.recapture_reason
    again = engine.generate(ids, mask, SamplingParams(stop_sequences=sequences, **base))
    assert again.stats.captures == 2 and torch.equal(again.sequences, first.sequences)
    plain = engine.generate(ids, mask, SamplingParams(**base))
    assert torch.equal(plain.sequences, free.sequences) and plain.stats.captures == 2
    assert plain.stop_sequences is None


def test_stop_sequences_of_sampled_seeded_rows_graph_equals_eager():
    model = tiny_model("qwen2")
    ids, mask = prompts(3, seed=2)
    sampled = {"do_sample": True, "temperature": 0.8, "seed": 9, "max_new_tokens": NEW, **NO_EOS}
    free = make_engine(model, graph=False).generate(ids, mask, SamplingParams(**sampled))
    width = ids.shape[1]
    stop = [tuple(free.sequences[r, width + 2 : width + 4].tolist()) for r in range(3)]
    params = SamplingParams(stop_sequences=stop, **sampled)
    graph = make_engine(model).generate(ids, mask, params)
    eager = make_engine(model, graph=False).generate(ids, mask, params)
    assert graph.stats.path == "static_graph"
    assert torch.equal(graph.sequences, eager.sequences)
    assert graph.finish_reasons == eager.finish_reasons == ["stop"] * 3


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stop_strings_equal_generate_with_a_tokenizer(family):
    """transformers' StopStringCriteria matches strings; with a tokenizer whose tokens are
    whole words, a string has one tokenisation and both engines stop on the same token."""
    model = tiny_model(family)
    tok = word_tokenizer()
    ids, mask = prompts(3, seed=5)
    width = ids.shape[1]
    free = make_engine(model, graph=False).generate(ids, mask, SamplingParams(max_new_tokens=NEW))
    assert free.response_lengths[0] == NEW  # row 0 runs into the stop string, not EOS
    texts = [tok.decode(free.sequences[0, width + 2 : width + 4]), f"t{VOCAB - 1}" * 3]
    config = GenerationConfig(max_new_tokens=NEW, stop_strings=texts, eos_token_id=EOS)
    params = SamplingParams.from_generation_config(config, tokenizer=tok)
    assert params.include_stop_str_in_output  # generate keeps the stop string
    ours = make_engine(model).generate(ids, mask, params)
    assert ours.stats.path == "static_graph" and ours.finish_reasons[0] == "stop"
    reference = generate_padded(
        model,
        ids,
        mask,
        width + NEW,
        max_new_tokens=NEW,
        do_sample=False,
        stop_strings=texts,
        tokenizer=tok,
    )
    assert torch.equal(ours.sequences, reference)
    with pytest.raises(ValueError, match="tokenizer="):
        SamplingParams.from_generation_config(config)


def test_stop_sequences_on_the_continuous_path_graph_equals_eager_and_static():
    model = tiny_model("llama")
    ids, mask = prompts(4, seed=5)
    sequences, _ = stop_plan(model, ids, mask)
    for keep in (True, False):
        params = SamplingParams(
            max_new_tokens=NEW, stop_sequences=sequences, include_stop_str_in_output=keep, **NO_EOS
        )
        static = make_engine(model, graph=False).generate(ids, mask, params)
        runs = [
            make_engine(model, graph=g, continuous_batch_size=2, eos_check_interval=2).generate(
                ids, mask, params
            )
            for g in (True, False)
        ]
        assert runs[0].stats.path == "continuous_graph"
        for run in runs:
            assert torch.equal(run.sequences, static.sequences)
            assert torch.equal(run.response_mask, static.response_mask)
            assert run.finish_reasons == static.finish_reasons
            assert run.stop_sequences == static.stop_sequences


# ---- presence / frequency penalties -------------------------------------------------------------
PENALISED = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0},
    {"presence_penalty": -0.5, "frequency_penalty": 0.7},
]


@pytest.mark.parametrize("family", ["gpt2", "llama", "opt"])
def test_presence_and_frequency_penalties_graph_equals_eager_and_vllm_math(family):
    model = tiny_model(family)
    ids, mask = prompts(3, seed=6)
    base = {"max_new_tokens": NEW, "return_logprobs": True, **NO_EOS}
    rows = [SamplingParams(**base, **row) for row in PENALISED]
    graph = make_engine(model).generate(ids, mask, rows)
    eager = make_engine(model, graph=False).generate(ids, mask, rows)
    assert graph.stats.path == "static_graph"
    assert torch.equal(graph.sequences, eager.sequences)
    torch.testing.assert_close(graph.logprobs, eager.logprobs, rtol=0, atol=1e-6)
    assert not torch.equal(graph.sequences, free_run(model, ids, mask).sequences)
    # vLLM's math, from teacher-forced logits: counts of the row's own generated tokens only
    logits = teacher_forced_logits(model, graph.sequences, mask, NEW)
    for r, params in enumerate(rows):
        out = graph.responses[r].tolist()
        for t in range(NEW):
            counts = torch.bincount(torch.tensor(out[:t], dtype=torch.long), minlength=VOCAB)
            scores = (
                logits[r, t]
                - params.frequency_penalty * counts
                - params.presence_penalty * (counts > 0)
            )
            assert int(scores.argmax()) == out[t], (r, t)
            expected = torch.log_softmax(scores, -1)[out[t]]
            torch.testing.assert_close(graph.logprobs[r, t], expected, rtol=0, atol=1e-4)


def test_presence_and_frequency_penalties_on_the_continuous_path_equal_the_static_path():
    model = tiny_model("qwen2")
    ids, mask = prompts(4, seed=3)
    rows = [SamplingParams(max_new_tokens=NEW, **NO_EOS, **PENALISED[i % 3]) for i in range(4)]
    static = make_engine(model, graph=False).generate(ids, mask, rows)
    for graph in (True, False):
        engine = make_engine(model, graph=graph, continuous_batch_size=2)
        result = engine.generate(ids, mask, rows, request_max_new_tokens=[NEW, 3, NEW, 5])
        for row, limit in enumerate([NEW, 3, NEW, 5]):
            width = ids.shape[1]
            assert torch.equal(
                result.sequences[row, : width + limit], static.sequences[row, : width + limit]
            ), (graph, row)


# ---- top-k alternative log-probs -----------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_top_logprobs_graph_equals_eager_and_log_softmax_top_k(family):
    model = tiny_model(family)
    ids, mask = prompts(3, seed=4)
    width = ids.shape[1]
    vllm = SamplingParams.from_vllm(temperature=0, logprobs=3, max_tokens=NEW)
    assert vllm.top_logprobs == 3 and vllm.return_logprobs
    rows = [
        SamplingParams(max_new_tokens=NEW, top_logprobs=3, logprobs_mode="raw", **NO_EOS),
        SamplingParams(
            do_sample=True, temperature=0.7, seed=2, max_new_tokens=NEW, top_logprobs=3, **NO_EOS
        ),
        SamplingParams(max_new_tokens=NEW, top_logprobs=3, logprobs_mode="raw", **NO_EOS),
    ]
    engine = make_engine(model)
    graph = engine.generate(ids, mask, rows)
    eager = make_engine(model, graph=False).generate(ids, mask, rows)
    assert graph.stats.path == "static_graph"
    assert graph.top_logprobs.shape == (3, NEW, 3)
    for name in ("sequences", "logprobs", "top_logprobs", "top_logprob_ids"):
        assert torch.equal(getattr(graph, name), getattr(eager, name)), name
    # greedy rows ("raw"): the top-3 of log_softmax(logits), the chosen token first
    logits = teacher_forced_logits(model, graph.sequences, mask, NEW)
    for r in (0, 2):
        values, index = torch.log_softmax(logits[r], -1).topk(3, dim=-1)
        assert torch.equal(graph.top_logprob_ids[r], index)
        torch.testing.assert_close(graph.top_logprobs[r], values, rtol=0, atol=1e-4)
        assert torch.equal(graph.top_logprob_ids[r, :, 0], graph.sequences[r, width:])
    # the sampled row: the chosen token's log-prob is among the recorded distribution's
    assert (graph.logprobs[1] <= graph.top_logprobs[1, :, 0] + 1e-6).all()
    # fewer alternatives read the held records: no recapture
    fewer = engine.generate(ids, mask, [replace(r, top_logprobs=1) for r in rows])
    assert fewer.stats.captures == 1 and torch.equal(
        fewer.top_logprobs, graph.top_logprobs[..., :1]
    )
    with pytest.raises(ValueError, match="top_logprobs"):
        make_engine(model, continuous_batch_size=2).generate(ids, mask, rows)


def test_from_vllm_log_probs_are_vllms_raw_ones_by_default_and_map_its_modes():
    """vLLM's ``logprobs_mode`` defaults to ``raw_logprobs``: the chosen token's log-prob
    under log_softmax of the model's logits, before the penalties, temperature and truncation
    the token was drawn under; ``processed_logprobs`` is graphcap's ``"sampling"``."""
    model = tiny_model("llama")
    ids, mask = prompts(3, seed=2)
    vllm = {"temperature": 0.7, "top_k": 6, "repetition_penalty": 1.3, "seed": 5}
    vllm |= {"max_tokens": NEW, "logprobs": 0, "ignore_eos": True}
    raw = SamplingParams.from_vllm(**vllm)
    assert raw.logprobs_mode == "raw" and raw.return_logprobs and not raw.top_logprobs
    processed = SamplingParams.from_vllm(**vllm, logprobs_mode="processed_logprobs")
    assert processed == replace(raw, logprobs_mode="sampling")
    engine = make_engine(model)
    got = engine.generate(ids, mask, raw)
    logits = teacher_forced_logits(model, got.sequences, mask, NEW)
    expected = torch.log_softmax(logits, -1).gather(-1, got.responses[..., None])[..., 0]
    torch.testing.assert_close(got.logprobs, expected, rtol=0, atol=1e-4)
    drawn = engine.generate(ids, mask, processed)
    assert torch.equal(drawn.sequences, got.sequences)  # the same draws, other log-probs
    assert (drawn.logprobs - got.logprobs).abs().max() > 0.1
    assert SamplingParams.from_vllm(logprobs_mode="temperature").logprobs_mode == "temperature"
    for mode, record in (("raw_logits", "output_logits=True"), ("processed_logits", "scores")):
        with pytest.raises(ValueError, match=rf"logprobs_mode='{mode}'.*{record}"):
            SamplingParams.from_vllm(logprobs=1, logprobs_mode=mode)


# ---- the one table -----------------------------------------------------------------------------
def test_configuration_docs_list_each_generation_config_field_once():
    """docs/configuration.md's allow-list and its refused list never name the same field."""
    text = DOCS.read_text()
    allowed = re.search(r"Allow-list((?:.+\n)+)", text).group(1)
    refused = re.search(r"Anything else set to a non-default value((?:.+\n)+)", text).group(1)
    listed = set(re.findall(r"`(\w+)`", allowed))
    assert set(GENERATION_CONFIG_FIELDS) <= listed
    assert not set(GENERATION_CONFIG_FIELDS) & set(re.findall(r"`(\w+)`", refused))
    table = text[text.index("## vLLM compatibility") :]
    for name in ("from_vllm", "sleep", "wake_up", "stop", "presence_penalty", "prompt_logprobs"):
        assert f"`{name}" in table, name
