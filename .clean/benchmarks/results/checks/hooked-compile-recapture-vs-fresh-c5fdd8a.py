"""Diagnostic (not committed): which configuration disagrees with eager when a hook is added."""
import json, sys
sys.path.insert(0, "tests")
import torch, graphcap
from rollout_models import prompts, tiny_model
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

backend = graphcap.get_backend("cuda")
P = SamplingParams(max_new_tokens=12, eos_token_id=[])
out = {}
def gen(model, ids, mask, **cfg):
    e = RolloutEngine(model, RolloutConfig(backend=backend, **cfg))
    r = e.generate(ids, mask, P); e.shutdown(); return r
for kind in ["none", "forward_hook", "forward_pre_hook", "global_hook"]:
    model = tiny_model("llama", fresh=True).to(backend.device)
    mlp = model.model.layers[0].mlp
    ids, mask = (t.to(backend.device) for t in prompts(3))
    eng = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=backend))
    first = eng.generate(ids, mask, P)
    if kind == "forward_hook": h = mlp.register_forward_hook(lambda m, a, o: o * 2.5)
    elif kind == "forward_pre_hook": h = mlp.register_forward_pre_hook(lambda m, a: (a[0] * 2.5,))
    elif kind == "global_hook": h = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: o * 2.5 if m is mlp else None)
    recap = eng.generate(ids, mask, P)
    eager = gen(model, ids, mask, enable_graph_capture=False)
    res = {"recapture_reason": recap.stats.recapture_reason, "compiled": recap.stats.compiled}
    for name, cfg in {"fresh_default": {}, "fresh_uncompiled": {"compile": False},
                      "fresh_no_cache": {"compile_cache": None}}.items():
        r = gen(model, ids, mask, enable_graph_capture=True, **cfg)
        res[name + "==eager"] = torch.equal(r.sequences, eager.sequences)
        res[name + "==recapture"] = torch.equal(r.sequences, recap.sequences)
    res["recapture==eager"] = torch.equal(recap.sequences, eager.sequences)
    res["first==eager_nohook_first"] = None
    res["eager"] = eager.sequences.tolist(); res["recap"] = recap.sequences.tolist()
    out[kind] = res
    print(kind, {k: v for k, v in res.items() if "==" in k}, flush=True)
    if kind != "none": h.remove()
json.dump(out, open(sys.argv[1], "w"), indent=1)
