import os

# Tests never reach the network: a hub id must fail fast with our error, not after a timeout.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
