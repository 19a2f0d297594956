"""The anchor cache: the AR teacher's hidden states precomputed once for Repr-Align (docs/design.md#the-seeds-methods).

As the seed's fork (dLLM-castlehill ``scripts/precompute_anchor.py``) does, the teacher's states are computed once
and read during training, so that a step runs no teacher forward. A cache is a directory:

* ``manifest.json``: the key ``{tokenizer, teacher, layers, dtype, logit_shift}`` (``tokenizer`` = sha256 of the
  tokenizer's serialisation, ``teacher`` = sha256 over every weight's name, dtype, shape and bytes) and, per
  example, the sha256 of its token ids -> its shard;
* ``anchors-NNNNN.safetensors``: per example ``<hash>.pos`` (``[n]`` int64 answer positions) and ``<hash>.L<l>``
  (``[n, H]`` in ``dtype``): the states at the positions that predict each answer token (``teacher_positions``).

Any difference between the key and the running setup (another teacher weight, tokenizer, layer list, dtype, logit
shift) is an :class:`AnchorError` naming the differing part, and an example missing from the cache is an error too:
never a silent miss or a silent recompute.

Bounds: only answer positions are stored (prompt positions are never masked), only the chosen layers, in float16 by
default, and the build refuses to start when its size estimate exceeds ``budget_bytes`` (SmolLM2-135M, 30 layers x
576 dims x 2 bytes = 34.6 KB per answer token: 10,000 answer tokens = 346 MB for all layers). The trainer's default is
the live teacher (``unmask.training.experimental.align.LiveTeacher``): on a CPU the 135M teacher's forward costs a
fraction of the student's forward + backward, while the cache for every layer of a few thousand answers is
gigabytes; the cache pays off with a layer subset or a teacher much larger than the student.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..common import ids_hash
from .align import AlignError, LiveTeacher, teacher_positions

__all__ = ["AnchorError", "AnchorCache", "tokenizer_fingerprint", "weights_fingerprint", "ids_hash",
           "DEFAULT_BUDGET_BYTES"]

DEFAULT_BUDGET_BYTES = 2 * 1024**3
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SHARD_EXAMPLES = 256


class AnchorError(AlignError):
    """The anchor cache does not match the run (names the differing part), lacks an example, or exceeds its budget."""


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's serialisation (fast tokenizers) or of its sorted vocabulary and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    text += json.dumps(sorted(map(str, getattr(tokenizer, "all_special_tokens", []))))
    return hashlib.sha256(text.encode()).hexdigest()


def weights_fingerprint(model) -> str:
    """sha256 over every state-dict entry's name, dtype, shape and bytes, in name order (any changed weight changes
    it)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class AnchorCache:
    """A built cache opened for reading (see the module docstring). Use :meth:`build` and :meth:`open`.

    Attributes:
        path: the directory. key: the manifest's key. layers: 1-based layers stored.
    """

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = path, manifest
        self.key = manifest["key"]
        self.layers = list(self.key["layers"])
        self._shards: dict[str, dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------ key
    @staticmethod
    def make_key(teacher: LiveTeacher, tokenizer, dtype: str, logit_shift: bool) -> dict:
        if dtype not in DTYPES:
            raise AnchorError(f"--align-anchor-dtype: {dtype!r} is not one of {list(DTYPES)}")
        return {"tokenizer": tokenizer_fingerprint(tokenizer), "teacher": weights_fingerprint(teacher.model),
                "layers": list(teacher.layers), "dtype": dtype, "logit_shift": bool(logit_shift)}

    @classmethod
    def open(cls, path, teacher: LiveTeacher, tokenizer, dtype: str = "float16", logit_shift: bool = True
             ) -> "AnchorCache":
        """Open ``path`` for this teacher/tokenizer/layers/dtype.

        Raises:
            AnchorError: no manifest, or a key part differs (named, with both values).
        """
        path = Path(path)
        mf = path / "manifest.json"
        if not mf.is_file():
            raise AnchorError(f"--align-anchors {path}: no manifest.json (build it first)")
        manifest = json.loads(mf.read_text())
        want = cls.make_key(teacher, tokenizer, dtype, logit_shift)
        for part in ("teacher", "tokenizer", "layers", "dtype", "logit_shift"):
            if manifest["key"].get(part) != want[part]:
                raise AnchorError(f"--align-anchors {path}: built for {part} {manifest['key'].get(part)!r}, this run "
                                  f"has {want[part]!r}; rebuild the cache (a new directory) or use the setup it was "
                                  "built with")
        return cls(path, manifest)

    @classmethod
    def build(cls, path, teacher: LiveTeacher, tokenizer, examples, dtype: str = "float16", logit_shift: bool = True,
              budget_bytes: int = DEFAULT_BUDGET_BYTES, batch_size: int = 8) -> "AnchorCache":
        """Compute and write the states of every example's answer positions.

        Args:
            examples: objects with ``input_ids`` (list[int]) and ``answer`` (list[bool]) (``training.data.Example``).
            budget_bytes: refuse (before computing anything) when the estimate exceeds it.

        Raises:
            AnchorError: ``path`` already holds a manifest, or the estimate exceeds the budget (both numbers).
        """
        from safetensors.torch import save_file

        path = Path(path)
        if (path / "manifest.json").exists():
            raise AnchorError(f"--align-anchors {path}: already built (open it, or choose a new directory)")
        key = cls.make_key(teacher, tokenizer, dtype, logit_shift)
        hidden = int(teacher.model.config.hidden_size)
        n_answer = sum(sum(bool(a) for a in ex.answer) for ex in examples)
        need = n_answer * len(teacher.layers) * hidden * torch.empty((), dtype=DTYPES[dtype]).element_size()
        if need > budget_bytes:
            raise AnchorError(f"--align-anchors {path}: {n_answer} answer tokens x {len(teacher.layers)} layers x "
                              f"{hidden} dims in {dtype} = {need / 1e6:.1f} MB exceeds the budget of "
                              f"{budget_bytes / 1e6:.1f} MB (--align-anchor-budget-mb): choose fewer layers or a "
                              "larger budget, or use the live teacher")
        path.mkdir(parents=True, exist_ok=True)
        entries: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        shard_i = 0

        def flush():
            nonlocal shard, shard_i
            if shard:
                name = f"anchors-{shard_i:05d}.safetensors"
                save_file(shard, str(path / name))
                shard_i += 1
                shard = {}

        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            L = max(len(ex.input_ids) for ex in chunk)
            ids = torch.zeros(len(chunk), L, dtype=torch.long)
            valid = torch.zeros(len(chunk), L, dtype=torch.bool)
            for b, ex in enumerate(chunk):
                ids[b, :len(ex.input_ids)] = torch.tensor(ex.input_ids)
                valid[b, :len(ex.input_ids)] = True
            states = teacher.all_states(ids, valid)
            for b, ex in enumerate(chunk):
                h = ids_hash(ex.input_ids)
                if h in entries:
                    continue
                pos = torch.tensor([i for i, a in enumerate(ex.answer) if a], dtype=torch.long)
                src = teacher_positions(pos, logit_shift).clamp_min(0)
                shard[f"{h}.pos"] = pos
                for layer, s in zip(teacher.layers, states):
                    shard[f"{h}.L{layer}"] = s[b, src].to(DTYPES[dtype]).contiguous().cpu()
                entries[h] = f"anchors-{shard_i:05d}.safetensors"
                if len(shard) >= SHARD_EXAMPLES * (1 + len(teacher.layers)):
                    flush()
        flush()
        manifest = {"key": key, "examples": entries}
        tmp = path / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest))
        tmp.replace(path / "manifest.json")  # the manifest last: a killed build leaves no half-valid cache
        return cls(path, manifest)

    # ------------------------------------------------------------------ reading
    def _shard(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._shards:
            from safetensors.torch import load_file

            self._shards[name] = load_file(str(self.path / name))
        return self._shards[name]

    def example_states(self, ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``([n] answer positions, [n, H] float32 per layer)`` of one example (its token ids).

        Raises:
            AnchorError: the example is not in the cache.
        """
        h = ids_hash(ids)
        name = self.manifest["examples"].get(h)
        if name is None:
            raise AnchorError(f"--align-anchors {self.path}: no states for an example with token-id hash {h[:16]} "
                              "(the data changed since the cache was built: rebuild it)")
        shard = self._shard(name)
        return shard[f"{h}.pos"], [shard[f"{h}.L{layer}"].float() for layer in self.layers]

    def states(self, batch, label_row: torch.Tensor, label_pos: torch.Tensor, logit_shift: bool = True
               ) -> list[torch.Tensor]:
        """``[N, H]`` per layer for the scored tokens ``(label_row, label_pos)`` of ``batch`` (same contract as
        :meth:`LiveTeacher.states`)."""
        per_row = {}
        out = [[] for _ in self.layers]
        for r, p in zip(label_row.tolist(), label_pos.tolist()):
            if r not in per_row:
                n = int(batch.valid[r].sum())
                pos, hs = self.example_states(batch.input_ids[r, :n])
                per_row[r] = ({int(q): i for i, q in enumerate(pos.tolist())}, hs)
            index, hs = per_row[r]
            if p not in index:
                raise AnchorError(f"--align-anchors {self.path}: position {p} is not an answer position of its "
                                  "cached example")
            for li, h in enumerate(hs):
                out[li].append(h[index[p]])
        hidden = int(next(iter(per_row.values()))[1][0].shape[-1]) if per_row else 0
        return [torch.stack(x) if x else torch.zeros(0, hidden) for x in out]
