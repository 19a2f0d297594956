"""``unmask convert SRC OUT``: turn an autoregressive checkpoint (HF directory or GGUF) into an ``a2d`` diffusion
checkpoint (docs/design.md#training; rules in :mod:`unmask.training.convert`); a LLaDA or Dream GGUF becomes the
Hugging Face checkpoint it was converted from (docs/design.md#model-families, "GGUF files";
:mod:`unmask.engine.families.gguf_diffusion`)."""
from __future__ import annotations

import argparse
import sys
import time

ATTENTION_CHOICES = ("bidirectional", "block_causal", "prefix_causal")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def register(sub, name):
    """Add the ``unmask convert`` sub-parser (named ``name``) and its options; returns it."""
    p = sub.add_parser(name, help="convert an AR checkpoint (HF directory or GGUF) into an a2d diffusion checkpoint",
                       description="Add a mask token, set attention mode / block size / logit shift, and write a "
                                   "servable a2d checkpoint.")
    p.add_argument("src", metavar="SRC", help="HF causal-LM directory, a directory holding a .gguf file, or a .gguf file")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist or be empty)")
    p.add_argument("--gguf-file", default=None, metavar="NAME", help="GGUF file name inside SRC")
    p.add_argument("--attention", default="prefix_causal", metavar="MODE",
                   help="bidirectional | block_causal | prefix_causal (default; recommended for AR parents)")
    p.add_argument("--block-size", default="4", metavar="N", help="default block size written to the checkpoint")
    p.add_argument("--logit-shift", action=argparse.BooleanOptionalAction, default=True,
                   help="read position j's logits from output j-1 (AR parents; default on)")
    p.add_argument("--mask-token", default="<|mask|>", help="text of the mask token to reuse or add")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (also a diffusion GGUF's weights; "
                                                        "its other settings come from the file)")
    return p


def _diffusion_gguf(args: argparse.Namespace):
    """The GGUF file SRC names when its ``general.architecture`` is a diffusion one, else None."""
    from unmask.engine.families.gguf_diffusion import DIFFUSION_ARCHS
    from unmask.engine.gguf_file import GGUFFile, is_gguf_file
    from unmask.training.common import ConversionError, resolve_source

    try:
        src_dir, name = resolve_source(args.src, args.gguf_file)
    except ConversionError:
        return None  # convert_checkpoint reports it
    path = src_dir / name if name else None
    if path is None or not is_gguf_file(path):
        return None
    from unmask.engine.config import CheckpointError

    try:
        arch = GGUFFile(path).get("general.architecture")
    except CheckpointError:
        return None  # convert_checkpoint reports the unreadable file
    return path if arch in DIFFUSION_ARCHS else None


def _convert_diffusion_gguf(args: argparse.Namespace, t0: float) -> int:
    from unmask.cli.main import UsageError
    from unmask.engine.checkpoint import CheckpointWriteError
    from unmask.engine.config import CheckpointError
    from unmask.engine.families.gguf_checkpoint import write_family_checkpoint
    from unmask.engine.model import resolve_dtype

    path = _diffusion_gguf(args)
    try:
        ckpt = write_family_checkpoint(path, args.out, resolve_dtype(args.dtype, None))
    except (CheckpointError, CheckpointWriteError) as exc:
        raise UsageError(str(exc).splitlines()[0]) from exc
    types = ", ".join(f"{k} x{v}" for k, v in sorted(ckpt.tensor_types.items()))
    print(f"wrote {args.out} ({ckpt.family} from {path.name}: {types}; mask_token_id="
          f"{ckpt.config.get('mask_token_id', 'from the tokenizer')}) in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """Validate the options, convert ``SRC`` into ``OUT`` and log the written ``dllm`` settings to stderr; returns 0.

    Raises:
        UsageError: bad ``--attention``/``--block-size``/``--dtype``/``--mask-token``, or the conversion/write failed.
    """
    from unmask.cli.main import UsageError

    if args.attention not in ATTENTION_CHOICES:
        raise UsageError(f"--attention: {args.attention!r} is not one of {' | '.join(ATTENTION_CHOICES)}")
    try:
        block_size = int(args.block_size)
    except ValueError:
        raise UsageError(f"--block-size: must be a positive integer, got {args.block_size!r}") from None
    if block_size < 1:
        raise UsageError(f"--block-size: must be a positive integer, got {block_size}")
    if args.dtype not in DTYPE_CHOICES:
        raise UsageError(f"--dtype: {args.dtype!r} is not one of {' | '.join(DTYPE_CHOICES)}")
    if not args.mask_token:
        raise UsageError("--mask-token: must not be empty")

    from unmask.engine.checkpoint import CheckpointWriteError
    from unmask.training.convert import ConversionError, convert_checkpoint

    t0 = time.perf_counter()
    if _diffusion_gguf(args):
        return _convert_diffusion_gguf(args, t0)
    try:
        out = convert_checkpoint(args.src, args.out, attention=args.attention, block_size=block_size,
                                 logit_shift=args.logit_shift, gguf_file=args.gguf_file, mask_token=args.mask_token,
                                 dtype=args.dtype)
    except (ConversionError, CheckpointWriteError) as exc:
        raise UsageError(str(exc).splitlines()[0]) from exc
    from unmask.engine.model import read_config

    d = read_config(out)["dllm"]
    print(f"wrote {out} (a2d, attention={d['attention']}, block_size={d['block_size']}, "
          f"logit_shift={d['logit_shift']}, mask_token_id={d['mask_token_id']}, eos={d['eos_token_ids']}) "
          f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0
