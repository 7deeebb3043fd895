"""Diagnostic (not committed): which compiled-capture setting makes a hooked model differ from eager."""
import json, sys
sys.path.insert(0, "tests")
import torch, graphcap
from rollout_models import prompts, tiny_model
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
import graphcap.rollout.regions as regions
import graphcap_cuda.backend as cb
from graphcap_cuda.kernels import launch

backend = graphcap.get_backend("cuda")
P = SamplingParams(max_new_tokens=12, eos_token_id=[])
def gen(model, ids, mask, **cfg):
    e = RolloutEngine(model, RolloutConfig(backend=backend, compile_cache=None, **cfg))
    r = e.generate(ids, mask, P); e.shutdown(); return r
FLAGS = {"combo": (cb, "COMBO_KERNELS"), "pdl": (launch, "ENABLED"), "blas": (cb, "CAPTURE_BLAS"),
         "bookkeeping": (regions, "COMPILE_BOOKKEEPING"), "epilogues": (cb, "EPILOGUES")}
OFF = {"combo": False, "pdl": False, "blas": None, "bookkeeping": False, "epilogues": False}
ON = {k: getattr(m, a) for k, (m, a) in FLAGS.items()}
def setflags(off):
    for k, (m, a) in FLAGS.items(): setattr(m, a, OFF[k] if k in off else ON[k])
out = {}
for change in ["hook", "scaled_weight"]:
    model = tiny_model("llama", fresh=True).to(backend.device)
    mlp = model.model.layers[0].mlp
    ids, mask = (t.to(backend.device) for t in prompts(3))
    if change == "hook": mlp.register_forward_hook(lambda m, a, o: o * 2.5)
    else:
        with torch.no_grad(): mlp.down_proj.weight.mul_(2.5)
    eager = gen(model, ids, mask, enable_graph_capture=False)
    for off in [(), ("combo",), ("pdl",), ("blas",), ("bookkeeping",), ("combo", "pdl"), tuple(FLAGS)]:
        setflags(off); torch.compiler.reset()
        r = gen(model, ids, mask, enable_graph_capture=True)
        name = f"{change}:off={'+'.join(off) or 'none'}"
        out[name] = {"equal": torch.equal(r.sequences, eager.sequences), "compiled": r.stats.compiled,
                     "path": r.stats.path, "diffs": int((r.sequences != eager.sequences).sum())}
        print(name, out[name], flush=True)
    setflags(())
json.dump(out, open(sys.argv[1], "w"), indent=1)
