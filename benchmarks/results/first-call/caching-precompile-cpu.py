"""Whether dynamo's experimental caching precompile (``TORCH_CACHING_PRECOMPILE=1``) lets a new
process skip tracing: three blocks compiled in one process, PyTorch's cache artefacts saved
(precompile entries included), then loaded in a new process with an empty inductor cache before
the same blocks compile. A diagnostic kept beside its output (architecture.md, decision 37).

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python caching-precompile-cpu.py save ART.bin
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python caching-precompile-cpu.py load ART.bin
"""

import sys
import time

import torch

torch._dynamo.config.caching_precompile = True  # private: the experiment's switch
from torch._dynamo.utils import compilation_time_metrics, counters  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.n = torch.nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n(torch.relu(self.a(x)) + x)


action, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
if action == "load":
    with open(path, "rb") as handle:
        print("loaded:", torch.compiler.load_cache_artifacts(handle.read()), flush=True)
blocks = [torch.compile(Block().forward) for _ in range(3)]
x = torch.randn(4, 64)
start = time.perf_counter()
for block in blocks:
    x = block(x)
traced = compilation_time_metrics.get("bytecode_tracing", [])
print(f"first calls {time.perf_counter() - start:.2f} s; frames traced by dynamo: {len(traced)}")
print("dynamo counters:", dict(counters["stats"]), "inductor:", dict(counters["inductor"]))
if action == "save":
    data, info = torch.compiler.save_cache_artifacts()
    with open(path, "wb") as handle:
        handle.write(data)
    print("saved:", info)
