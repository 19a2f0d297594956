"""A diffusion draft head: drafts for speculative decoding from the verifier's own hidden states.

The mask-group drafter of :mod:`unmask.engine.speculative` forwards a whole model over mask tokens placed after the
drafts, so its first draft predicts token ``c + 1`` without knowing token ``c`` (the verifier's correction, decided
in the same forward). A draft head runs *after* the verification, on the verifier's last hidden states, and
conditions on every final token including the correction: the idea of EAGLE (Li et al. 2024, "EAGLE: Speculative
Sampling Requires Rethinking Feature Uncertainty", arXiv:2401.15077: a one-layer decoder over ``(feature, next
token)`` pairs), here with a *masked-diffusion* draft block instead of EAGLE's feature-level autoregression, so one
head forward can reveal several drafts at once (dynamic reveal counts, as the engine's denoising).

Rows of one head forward (logit-shift convention of the A2D models: the output of the row for position ``t``
predicts token ``t + 1``):

* context rows, one per final position ``t`` of the last ``window``: input ``fc([h_{t-1}; E(x_t)])`` where
  ``h_{t-1}`` is the verifier's last hidden state at ``t - 1`` (post final norm, what its LM head reads) and
  ``E`` the verifier's token embedding; causal among themselves (row ``t`` sees ``t - window + 1 .. t``);
* draft rows for positions ``c + 1 .. c + k - 1`` (``c`` = the last final position): input ``fc([0; E(y)])``
  with ``y`` a revealed draft or the mask token; they see every context row and every draft row (bidirectional
  inside the draft block, as a prefix-causal dLLM's block).

The context row ``c`` predicts the first draft (token ``c + 1``), draft row ``c + i`` predicts token ``c + i + 1``.
Logits cover ``draft_vocab`` only (the ``K`` most frequent answer tokens of the training data, as FR-Spec, Zhao et
al. 2025, arXiv:2502.14856), through the verifier's LM head rows of those ids. Drafting reveals the leftmost masked
draft every forward, and with ``threshold < 1`` also every other masked draft whose head confidence is at least
``threshold`` (Fast-dLLM's threshold rule). The verifier checks every draft, so the head changes only the speed,
never the tokens (exact verification) or their distribution (speculative sampling).

This module is the drafting side: :class:`DraftHeadRuntime` (a head bound to its verifier; the draft-head seam the
speculative strategy calls, ``LoadedModel.draft_head``), :func:`load_draft_head` and the draft vocabulary
(:func:`draft_vocab_from_counts`). The head's weights, config and files: :mod:`unmask.engine.draft_head_model`
(its names are re-exported here). docs/design.md section 13.

Checkpoint: ``dllm.draft_head`` names a directory (relative to the checkpoint) with ``config.json``
(:class:`DraftHeadConfig`) and ``model.safetensors`` (the head's weights and ``draft_vocab``).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .config import CheckpointError
from .draft_head_model import (HEAD_CONFIG, HEAD_DIR, HEAD_WEIGHTS, DraftHead,  # noqa: F401 (re-exported)
                               DraftHeadConfig, head_rows_mask)


class DraftHeadRuntime:
    """A loaded head bound to its verifier: the embedding matrix and the LM-head rows of ``draft_vocab``.

    Args:
        head: the head (eval mode; its device is the model's).
        embedding: ``[V, H]`` the verifier's input embedding weight.
        lm_rows: ``[K, H]`` float the verifier's LM-head rows of ``head.draft_vocab``.
    """

    def __init__(self, head: DraftHead, embedding: torch.Tensor, lm_rows: torch.Tensor):
        self.head = head
        self.embedding = embedding
        self.lm_rows = lm_rows
        self.cfg = head.cfg
        self.vocab = head.draft_vocab
        self.weight_format = "native"
        self._lm = lambda hidden: head.logits(hidden, lm_rows)

    def pack_fp16(self) -> None:
        """Run the head's linear layers and its LM-head rows through fbgemm's fp16 GEMM
        (:mod:`unmask.engine.packed_weights`), as the verifier's on a CPU: a head forward is a few rows against
        ~5M weights plus the ``[K, H]`` LM rows, so reading half the bytes is most of its cost. Inference only."""
        from .packed_weights import fp16_linear, pack_linears_fp16

        if self.weight_format == "fp16":
            return
        pack_linears_fp16(self.head)
        lm = fp16_linear(self.lm_rows.float(), None)
        self._lm = lambda hidden: lm(hidden.float())
        self.weight_format = "fp16"

    @torch.inference_mode()
    def draft(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, n_drafts: int,
              pick, threshold: float | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Draft ``n_drafts`` tokens after the last context row.

        Args:
            features: ``[W, H]`` verifier hidden states ``h_{t-1}`` of the context rows (oldest first, ``W <=
                window``). tokens: ``[W]`` int64 final tokens ``x_t``. positions: ``[W]`` int64 positions ``t``.
            n_drafts: drafts wanted (>= 1; the head drafts at most ``n_drafts``).
            pick: ``pick(logits [n, K] float32) -> (ids [n] int64 in draft-vocab indices, q [n, K] float64 or
                None)``: the request's rule (argmax, or a sample with the distribution it came from).
            threshold: reveal, besides the leftmost undecided draft, the undecided drafts right after it while
                their top head probability is at least this (a contiguous run) (1.0 = one draft per head forward, i.e. left to right); ``None`` = the head's
                ``reveal_threshold``.

        Returns:
            ``(drafts, qs)``: token ids, and per draft its ``[K]`` float64 distribution (empty list for argmax).
        """
        threshold = self.cfg.reveal_threshold if threshold is None else threshold
        W = int(features.shape[0])
        dev = features.device
        mask_id = self.cfg.mask_token_id
        c = int(positions[-1])
        n_rows_draft = max(0, n_drafts - 1)
        ids: list[int | None] = [None] * n_drafts
        qs: list[torch.Tensor | None] = [None] * n_drafts
        ctx_f = features.to(self.lm_rows.dtype)
        zeros = torch.zeros(n_rows_draft, ctx_f.shape[1], dtype=ctx_f.dtype, device=dev)
        feats = torch.cat((ctx_f, zeros))[None]
        pos = torch.cat((positions.to(dev), torch.arange(c + 1, c + 1 + n_rows_draft, device=dev)))[None]
        n_ctx = torch.tensor([W], device=dev)
        n_dr = torch.tensor([n_rows_draft], device=dev)
        mask = head_rows_mask(n_ctx, n_dr, W + n_rows_draft, self.cfg.window)
        while any(t is None for t in ids):
            draft_toks = [mask_id if t is None else t for t in ids[:n_rows_draft]]
            toks = torch.cat((tokens.to(dev), torch.tensor(draft_toks, dtype=torch.long, device=dev)))[None]
            hidden = self.head(feats, toks, pos, mask, self.embedding)[0]
            open_ = [i for i, t in enumerate(ids) if t is None]
            rows = torch.tensor([W - 1 + i for i in open_], device=dev)  # draft i is predicted by row W - 1 + i
            logits = self._lm(hidden[rows])
            picked, q = pick(logits)
            conf = torch.softmax(logits, dim=-1).max(-1).values
            for j, i in enumerate(open_):
                # reveal a contiguous run only: a draft revealed before an earlier one would condition that earlier
                # draft's distribution on it (draft rows see each other), and speculative sampling needs draft i
                # drawn from q_i given drafts < i only
                if j > 0 and float(conf[j]) < threshold:
                    break
                ids[i] = int(self.vocab[int(picked[j])])
                if q is not None:
                    qs[i] = q[j]
        return [int(t) for t in ids], [q for q in qs if q is not None]


def load_draft_head(directory: str | Path, verifier_model, mask_token_id: int, device: torch.device,
                    where: str) -> DraftHeadRuntime:
    """Load the head in ``directory`` and bind it to ``verifier_model`` (a transformers causal LM, before any weight
    packing): its input embedding and the LM-head rows of the head's ``draft_vocab``.

    Raises:
        CheckpointError: the head cannot be read, or does not fit the verifier (hidden size, vocabulary, mask id);
            the message starts with ``where``.
    """
    head = DraftHead.load(directory, device)
    emb = verifier_model.get_input_embeddings().weight
    out = verifier_model.get_output_embeddings().weight
    if head.cfg.hidden_size != emb.shape[1]:
        raise CheckpointError(f"{where}: the head's hidden_size {head.cfg.hidden_size} does not match the model's "
                              f"{emb.shape[1]}")
    if int(head.draft_vocab.max()) >= out.shape[0] or int(head.draft_vocab.min()) < 0:
        raise CheckpointError(f"{where}: draft_vocab holds ids outside the model's vocabulary [0, {out.shape[0]})")
    if head.cfg.mask_token_id != mask_token_id:
        raise CheckpointError(f"{where}: the head's mask_token_id {head.cfg.mask_token_id} is not the model's "
                              f"{mask_token_id}")
    lm_rows = out.detach()[head.draft_vocab.to(out.device)].float().to(device)
    head = head.float()
    return DraftHeadRuntime(head, emb.detach(), lm_rows)


def draft_vocab_from_counts(counts: torch.Tensor, size: int, always: list[int], never: list[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent ids of ``counts`` (``[V]`` int64 token counts), with every id of ``always``
    (EOS ids) included and no id of ``never`` (the model's ``never_generate_ids``: the mask token, padding rows; a
    draft of one would always be rejected, and with few answers zero-count ids fill the vocabulary); ascending.

    Raises:
        ValueError: ``size`` exceeds the vocabulary less ``never``.
    """
    V = counts.numel()
    never = sorted(set(int(t) for t in never if 0 <= int(t) < V) - set(int(t) for t in always))
    if size > V - len(never):
        raise ValueError(f"draft vocabulary size {size} exceeds the model's vocabulary {V} less its "
                         f"{len(never)} never-generated ids")
    scores = counts.to(torch.float64).clone()
    scores[never] = -math.inf
    for t in always:
        scores[t] = math.inf
    return torch.sort(torch.topk(scores, size).indices).values
