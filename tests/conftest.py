import os

# Tests never reach the network: a hub id must fail fast with our error, not after a timeout.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Without a CUDA GPU the Triton kernels (chapter 9) run in Triton's CPU interpreter, which must be switched on
# before triton is imported. `import torch` does not import triton, so torch can say first whether there is a GPU.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
