import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# Tiny models: one thread is faster than two (no thread hand-off per op) and avoids oversubscription when the
# machine is shared; real-model (slow) tests may raise it themselves.
torch.set_num_threads(1)
