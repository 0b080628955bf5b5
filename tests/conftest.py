import os

# Tests never reach the network: a hub id must fail fast with our error, not after a timeout.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Without a CUDA GPU the Triton kernels (chapter 9) run in Triton's CPU interpreter, which must be switched on
# before triton is imported. `import torch` does not import triton, so torch can say first whether there is a GPU.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def check_early_launches(monkeypatch):
    """check(run, module): `run(kept=None)` queues a chain of kernels from `module` (launched early, with programmatic
    dependent launch) and returns its result, appending every intermediate it makes to `kept`. The result must equal,
    bit for bit, that of the same chain with every launch plain; and so must a CUDA graph of it replayed with every
    intermediate poisoned first, so that a read before its write would see NaN, not the last replay's values."""
    def check(run, module):
        assert module._pdl(torch.device("cuda"))  # launched early indeed (not the interpreter)
        early = run()
        with monkeypatch.context() as m:
            m.setattr(module, "_pdl", lambda device: False)  # every launch plain
            plain = run()
        assert torch.equal(early, plain)
        graph, intermediates = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph): captured = run(intermediates)
        for _ in range(5):
            for t in intermediates + [captured]: t.fill_(float("nan"))
            graph.replay(); torch.cuda.synchronize()
            assert torch.equal(captured, plain)
    return check
