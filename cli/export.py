"""``unmask export SRC OUT --quantization nf4|int8|none``: a servable (quantized) checkpoint from a training run."""
from __future__ import annotations

import argparse
import json


def register(sub, name):
    """Add the ``unmask export`` sub-parser (named ``name``) and its options; returns it."""
    p = sub.add_parser(name, help="export a trained checkpoint (merged, optionally quantized with bitsandbytes)",
                       description="Write a servable checkpoint from a checkpoint directory or a training OUT "
                                   "(its latest), quantized with bitsandbytes NF4 / int8 or not at all.")
    p.add_argument("src", help="checkpoint directory, or a training output directory (uses its latest)")
    p.add_argument("out", help="new output directory")
    p.add_argument("--quantization", default="nf4", choices=["nf4", "int8", "none"])
    p.add_argument("--device", default="cpu", help="cpu | cuda (where to quantize)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (non-quantized tensors)")
    p.add_argument("--no-verify", action="store_true", help="skip the reload-and-compare-logits check")
    p.add_argument("--default-threshold", type=float, default=None,
                   help="decoding default stored in the checkpoint: requests that give neither steps nor threshold "
                        "get confidence-threshold decoding at this value (e.g. 0.7)")
    p.add_argument("--default-speculative", action=argparse.BooleanOptionalAction, default=None,
                   help="decoding default stored in the checkpoint: requests that do not set speculative (and fit "
                        "it: no steps/threshold/CFG/penalties) get self-speculative decoding (prefix_causal models; "
                        "temperature > 0: speculative sampling)")
    p.add_argument("--no-default-threshold", action="store_true",
                   help="drop the source's default threshold (requests without steps/threshold then decode one "
                        "token per step)")
    p.add_argument("--verifier-quantization", default=None, choices=["nf4", "int8", "none"],
                   help="quantization of the exported verifier (default none: the answers of speculative requests "
                        "stay exactly the full-precision verifier's)")
    p.add_argument("--no-verifier", action="store_true",
                   help="do not export the source's verifier (dllm.verifier): speculative requests then verify "
                        "with the model's own causal path")
    return p


def run(args: argparse.Namespace) -> int:
    """Export ``SRC`` to ``OUT`` and print the export's result as one JSON line; returns 0.

    Raises:
        UsageError: an ``ExportError`` or ``CheckpointError``.
    """
    from unmask.cli.main import UsageError
    from unmask.engine.config import CheckpointError
    from unmask.training.export import ExportError, export

    try:
        res = export(args.src, args.out, args.quantization, device=args.device, dtype=args.dtype,
                     verify=not args.no_verify, default_threshold=args.default_threshold,
                     default_speculative=args.default_speculative, keep_verifier=not args.no_verifier,
                     clear_default_threshold=args.no_default_threshold,
                     verifier_quantization=args.verifier_quantization)
    except (ExportError, CheckpointError) as exc:
        raise UsageError(str(exc)) from exc
    print(json.dumps(res))
    return 0
