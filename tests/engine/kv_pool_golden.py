"""The paged KV pool's golden tokens (docs/design.md#decoding, "KV cache"): each decoding path's tokens under the
cache before the pool (commit 9267790: one contiguous buffer per lane and layer), recorded by running this file
against that commit, and compared with the pool's by ``tests/engine/test_kv_pool.py``.

Record (from a checkout of the old commit, importing its ``unmask``)::

    python tests/engine/kv_pool_golden.py tests/engine/golden/kv_pool_paths.json

A later change that alters these tokens on purpose (a sampling rule, a checkpoint of ``decoding_paths``) records them
again from its own tree with the same command, saying so in its commit; the pool's own equalities stay covered by
``test_kv_pool.py``'s other tests (pieces vs one SDPA call, fragmented pools, prefix-reusing chats).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

#: (path name, weights): float32 native weights run the transformers forward with lane attention, ``fp16`` the fused
#: decoder (padded attention before the pool, lane attention with it), ``int8`` the row-invariant attention (its
#: bit-exact per-lane calls)
CASES = (
    [(name, "native") for name in ("quota", "threshold", "multi-block", "cfg", "speculative-greedy",
                                   "speculative-sampled", "prefix-reuse", "block-causal", "sub-blocks",
                                   "bidirectional-cache-dual")]
    + [(name, "int8") for name in ("quota", "speculative-greedy", "prefix-reuse")]
    + [(name, "fp16") for name in ("quota", "threshold", "multi-block", "cfg", "speculative-greedy", "prefix-reuse",
                                   "block-causal")]
)


def run_cases(checkpoints: dict, cases=CASES) -> dict[str, list[list[int]]]:
    """``{"path/weights": token ids of each request}`` (batch of up to 8, float32)."""
    import decoding_paths as dp
    from unmask.engine import LLM
    from unmask.engine.model import load_model

    paths = {p.name: p for p in dp.PATHS}
    out, models = {}, {}
    for name, weights in cases:
        path = paths[name]
        key = (path.checkpoint, weights)
        if key not in models:
            models[key] = load_model(str(checkpoints[path.checkpoint]), device="cpu", dtype="float32",
                                     weights=weights)
        out[f"{name}/{weights}"] = dp.run_path(LLM(models[key], max_batch_size=8), path)
    return out


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent)]
    import decoding_paths as dp

    with tempfile.TemporaryDirectory() as tmp:
        tokens = run_cases(dp.write_checkpoints(Path(tmp)))
    Path(sys.argv[1]).write_text(json.dumps(tokens, indent=1) + "\n")
    print(f"wrote {len(tokens)} cases to {sys.argv[1]}")
