"""``unmask train-head``: train a diffusion draft head (:mod:`unmask.engine.draft_head`) for a frozen verifier.

The verifier (normally the untrained conversion of the AR parent, whose ``block_size=1`` decoding *is* the parent)
runs once over every training document and its last hidden states are kept (cached on disk under
``OUT/head_train/``); the head then trains on them for a wall-clock budget. Each example gives, in one head forward:

* context rows for every position ``t >= 1`` (``fc([h_{t-1}; E(x_t)])``, causal within the sliding ``window``), whose
  outputs learn the first draft ``x_{t+1}``;
* ``groups`` draft blocks at random answer positions ``c``: rows for ``c + 1 .. c + k - 1`` holding the true token
  (revealed) or the mask token, revealed with a per-block ratio drawn from U(0, 1) (the masked-diffusion objective,
  so that drafting may reveal any subset), seeing the context rows of ``c - window + 1 .. c`` and each other; a row
  learns the next token whenever that token's own row is masked or outside the block.

Loss: cross-entropy over the draft vocabulary (the ``K`` most frequent answer tokens; targets outside it are not
counted) on answer tokens only, as EAGLE's classification loss (Li et al. 2024, arXiv:2401.15077; its feature
regression is left out). The output directory is a servable checkpoint: the verifier's files with
``dllm.draft_head = "draft_head"``, so ``unmask serve OUT`` drafts with the head and answers with the verifier's
tokens.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from unmask.engine.checkpoint import unique_suffix
from unmask.engine.draft_head import HEAD_DIR, DraftHead, DraftHeadConfig, draft_vocab_from_counts

from .data import eos_ids_of, load_dataset
from .head_config import HeadTrainConfig
from .trainer import BudgetClock, TrainError, make_scheduler

STATE_DIR = "head_train"


def _atomic_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{unique_suffix()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def prepare_output(verifier: Path, out: Path, max_drafts: int) -> None:
    """Make ``out`` a copy of the verifier checkpoint whose ``config.json`` names ``draft_head``, with block size
    ``max_drafts + 1`` and speculative decoding as its default (``dllm.default_sampling.speculative``: requests that
    fit it draft with the head and answer with the verifier's tokens). Files are copied once; ``config.json`` is
    written last and atomically, so a half-copied directory is never a valid checkpoint.

    Raises:
        TrainError: ``out`` exists and is a checkpoint of something else (its config differs from the verifier's).
    """
    vcfg = json.loads((verifier / "config.json").read_text())
    cfg = json.loads(json.dumps(vcfg))
    cfg["dllm"]["draft_head"] = HEAD_DIR
    cfg["dllm"]["verifier"] = None
    cfg["dllm"]["block_size"] = max_drafts + 1
    cfg["dllm"]["default_sampling"] = {**(cfg["dllm"].get("default_sampling") or {}), "speculative": True}
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").is_file():
        have = json.loads((out / "config.json").read_text())
        strip = lambda c: {k: v for k, v in c.items() if k != "dllm"}  # noqa: E731
        if strip(have) != strip(cfg):
            raise TrainError(f"--out {out}: holds another checkpoint (its config.json differs from the verifier's); "
                             "use a new directory")
        return
    for f in sorted(verifier.iterdir()):
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    _atomic_json(out / "config.json", cfg)


class FeatureStore:
    """Every document's token ids, answer mask and the verifier's last hidden states (``[n, H]`` bfloat16), kept
    in memory and cached in ``OUT/head_train/features.safetensors`` keyed by the verifier, data file and seq_len."""

    def __init__(self, ids: list[torch.Tensor], answer: list[torch.Tensor], feats: list[torch.Tensor]):
        self.ids, self.answer, self.feats = ids, answer, feats
        self.greedy: list[torch.Tensor] | None = None  # per document [n]: the verifier's argmax after position t

    def add_greedy(self, lm_head, chunk: int = 4096) -> None:
        """Fill :attr:`greedy` with the verifier's greedy next token after every position (``argmax`` of its LM
        head on the stored hidden state): the targets of ``--targets all``."""
        from tqdm import tqdm

        flat = torch.cat(self.feats)
        out = torch.empty(flat.shape[0], dtype=torch.long)
        with torch.inference_mode():
            for s in tqdm(range(0, flat.shape[0], chunk), desc="verifier greedy tokens", unit="chunk"):
                out[s: s + chunk] = lm_head(flat[s: s + chunk].float()).argmax(-1)
        self.greedy, o = [], 0
        for f in self.feats:
            self.greedy.append(out[o: o + f.shape[0]])
            o += f.shape[0]

    def __len__(self) -> int:
        return len(self.ids)

    @staticmethod
    def key(cfg: HeadTrainConfig) -> dict:
        st = os.stat(cfg.data)
        return {"verifier": str(Path(cfg.verifier).resolve()), "data": str(Path(cfg.data).resolve()),
                "data_size": st.st_size, "data_mtime": int(st.st_mtime), "seq_len": cfg.seq_len}

    @classmethod
    def build(cls, cfg: HeadTrainConfig, model, examples, cache: Path, log) -> "FeatureStore":
        from safetensors.torch import load_file, save_file

        key = cls.key(cfg)
        meta_f = cache.with_suffix(".json")
        if cache.is_file() and meta_f.is_file() and json.loads(meta_f.read_text()) == key:
            t = load_file(str(cache))
            offs = t["offsets"].tolist()
            ids = [t["ids"][a:b] for a, b in zip(offs[:-1], offs[1:])]
            ans = [t["answer"][a:b] for a, b in zip(offs[:-1], offs[1:])]
            feats = [t["features"][a:b] for a, b in zip(offs[:-1], offs[1:])]
            log(f"[train-head] features: {len(ids)} documents from {cache}")
            return cls(ids, ans, feats)
        from tqdm import tqdm

        order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
        feats: list[torch.Tensor | None] = [None] * len(examples)
        decoder = model.base_model
        with torch.inference_mode(), tqdm(total=len(order), desc="verifier features", unit="doc") as bar:
            for s in range(0, len(order), cfg.feature_batch):
                chunk = order[s: s + cfg.feature_batch]
                L = max(len(examples[i].input_ids) for i in chunk)
                x = torch.zeros(len(chunk), L, dtype=torch.long)
                for b, i in enumerate(chunk):
                    x[b, : len(examples[i].input_ids)] = torch.tensor(examples[i].input_ids)
                # causal attention: right padding never changes the real rows
                h = decoder(input_ids=x, use_cache=False).last_hidden_state
                for b, i in enumerate(chunk):
                    feats[i] = h[b, : len(examples[i].input_ids)].to(torch.bfloat16).clone()
                bar.update(len(chunk))
        ids = [torch.tensor(e.input_ids, dtype=torch.long) for e in examples]
        ans = [torch.tensor(e.answer, dtype=torch.bool) for e in examples]
        offs = [0]
        for t in ids:
            offs.append(offs[-1] + len(t))
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.tmp-{unique_suffix()}")
        save_file({"ids": torch.cat(ids), "answer": torch.cat(ans), "features": torch.cat(feats),
                   "offsets": torch.tensor(offs)}, str(tmp))
        os.replace(tmp, cache)
        _atomic_json(meta_f, key)
        return cls(ids, ans, feats)


def build_batch(store: FeatureStore, idx: list[int], cfg: HeadTrainConfig, mask_id: int, vocab_index: torch.Tensor,
                rng: random.Random) -> dict:
    """Rows, attention mask and targets of one training step (see the module docstring).

    Returns a dict of ``features`` ``[B, R, H]`` float32, ``tokens``/``positions`` ``[B, R]`` int64, ``mask``
    ``[B, R, R]`` bool, ``targets`` ``[B, R]`` int64 draft-vocabulary indices (-1 = no loss) and ``is_ctx``
    ``[B, R]`` bool (context rows).
    """
    k, W = cfg.max_drafts, cfg.window
    rows = []
    for i in idx:
        x, a, h = store.ids[i], store.answer[i], store.feats[i].float()
        n = int(x.numel())
        H = h.shape[1]
        if cfg.targets == "all":  # tgt_tok[t] = the verifier's greedy token after position t, at every position
            tgt_tok = vocab_index[store.greedy[i]]
        else:  # tgt_tok[t] = vocab index of x_{t+1} when it is an answer token
            tgt_tok = torch.full((n,), -1, dtype=torch.long)
            nxt = vocab_index[x[1:]]
            tgt_tok[: n - 1] = torch.where(a[1:], nxt, torch.full_like(nxt, -1))
        feats = [h[: n - 1]]
        toks = [x[1:]]
        pos = [torch.arange(1, n)]
        targets = [tgt_tok[1:n]]  # context row of position t (t = 1..n-1) predicts the token after t
        see: list[tuple[int, int]] = []  # per group: (first context row it sees, its row count)
        anchor_pos = range(1, n) if cfg.targets == "all" else a.nonzero().flatten().tolist()
        anchors = [c for c in anchor_pos if c <= n - 2]
        groups = rng.sample(anchors, min(cfg.groups, len(anchors))) if k > 1 else []
        for c in groups:
            m = min(k - 1, n - 1 - c)
            ratio = rng.random()
            revealed = [rng.random() < ratio for _ in range(m)]
            gpos = torch.arange(c + 1, c + 1 + m)
            gtok = torch.where(torch.tensor(revealed), x[c + 1: c + 1 + m], torch.full((m,), mask_id))
            gt = torch.full((m,), -1, dtype=torch.long)
            for j in range(m):
                nxt_row_masked = j + 1 >= m or not revealed[j + 1]
                if nxt_row_masked:
                    gt[j] = tgt_tok[c + 1 + j]
            feats.append(torch.zeros(m, H))
            toks.append(gtok)
            pos.append(gpos)
            targets.append(gt)
            see.append((c, m))
        rows.append((torch.cat(feats), torch.cat(toks), torch.cat(pos), torch.cat(targets), n - 1, see))
    B = len(rows)
    R = max(r[0].shape[0] for r in rows)
    H = rows[0][0].shape[1]
    features = torch.zeros(B, R, H)
    tokens = torch.full((B, R), mask_id, dtype=torch.long)
    positions = torch.zeros(B, R, dtype=torch.long)
    targets = torch.full((B, R), -1, dtype=torch.long)
    is_ctx = torch.zeros(B, R, dtype=torch.bool)
    mask = torch.zeros(B, R, R, dtype=torch.bool)
    ar = torch.arange(R)
    for b, (f, t, p, y, n_ctx, see) in enumerate(rows):
        r = f.shape[0]
        features[b, :r], tokens[b, :r], positions[b, :r], targets[b, :r] = f, t, p, y
        is_ctx[b, :n_ctx] = True
        q, kk = ar[:n_ctx, None], ar[None, :n_ctx]
        mask[b, :n_ctx, :n_ctx] = (kk <= q) & (kk > q - W)
        row = n_ctx
        for c, m in see:  # context row of position t is row t - 1; the group sees positions c - W + 1 .. c
            lo = max(0, c - W)
            mask[b, row: row + m, lo: c] = True
            mask[b, row: row + m, row: row + m] = True
            row += m
        mask[b, ar, ar] = True  # padding rows see themselves
    return {"features": features, "tokens": tokens, "positions": positions, "mask": mask, "targets": targets,
            "is_ctx": is_ctx}


def head_loss(head: DraftHead, batch: dict, embedding: torch.Tensor, lm_rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Cross-entropy over the draft vocabulary at every row with a target; returns ``(loss, stats)`` where stats
    holds the first-draft accuracy (context rows) and the later-draft accuracy (draft rows)."""
    hidden = head(batch["features"], batch["tokens"], batch["positions"], batch["mask"], embedding)
    tgt = batch["targets"]
    sel = tgt >= 0
    logits = head.logits(hidden[sel], lm_rows)
    y = tgt[sel]
    loss = F.cross_entropy(logits, y)
    with torch.no_grad():
        hit = logits.argmax(-1) == y
        ctx = batch["is_ctx"][sel]
        stats = {"acc_first": float(hit[ctx].float().mean()) if bool(ctx.any()) else float("nan"),
                 "acc_later": float(hit[~ctx].float().mean()) if bool((~ctx).any()) else float("nan"),
                 "targets": int(sel.sum())}
    return loss, stats


def train_head(cfg: HeadTrainConfig, log=print) -> Path:
    """Run ``unmask train-head``; returns the output checkpoint directory.

    Raises:
        TrainError: bad options, a verifier that cannot draft (not prefix-causal with the logit shift), or an output
            directory holding another checkpoint.
        DataError: unreadable training data (``file:line``).
    """
    from unmask.engine.config import CheckpointError

    from .scopes import load_source

    cfg.validate()
    vpath, out = Path(cfg.verifier), Path(cfg.out)
    try:
        model, tokenizer, dllm = load_source(vpath)
    except (CheckpointError, OSError, ValueError) as exc:
        raise TrainError(f"--verifier {vpath}: {exc}") from exc
    if not (dllm.attention == "prefix_causal" and dllm.logit_shift):
        raise TrainError(f"--verifier {vpath}: a draft head needs a prefix_causal checkpoint with the logit shift "
                         f"(this one: {dllm.attention}, logit_shift={dllm.logit_shift})")
    if dllm.verifier:
        raise TrainError(f"--verifier {vpath}: routes its causal rows to another verifier ({dllm.verifier}); give "
                         "that checkpoint instead")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ds = load_dataset(cfg.data, tokenizer, cfg.seq_len, set(eos_ids_of(tokenizer, extra=dllm.eos_token_ids)))
    prepare_output(vpath, out, cfg.max_drafts)
    state_dir = out / STATE_DIR
    state_dir.mkdir(exist_ok=True)
    store = FeatureStore.build(cfg, model, ds.examples, state_dir / "features.safetensors", log)

    if cfg.targets == "all":
        store.add_greedy(model.get_output_embeddings())
    V = int(model.get_output_embeddings().weight.shape[0])
    K = min(cfg.draft_vocab_size, V)
    state_f = state_dir / "state.json"
    prev = json.loads(state_f.read_text()) if state_f.is_file() else None
    head_dir = out / HEAD_DIR
    if prev is not None and (head_dir / "model.safetensors").is_file():
        if prev.get("key") != FeatureStore.key(cfg):
            raise TrainError(f"--out {out}: holds a head trained on other data/verifier ({prev.get('key')}); use a "
                             "new directory")
        head = DraftHead.load(head_dir)
        for name, have in (("window", head.cfg.window), ("max_drafts", head.cfg.max_drafts),
                           ("draft_vocab_size", head.cfg.draft_vocab_size), ("num_layers", head.cfg.num_layers)):
            want = K if name == "draft_vocab_size" else getattr(cfg, name)
            if want != have:
                raise TrainError(f"--{name.replace('_', '-')}: {want} differs from the head being resumed in {out} "
                                 f"({have}); pass {have} or use a new --out")
        head.train()
        log(f"[train-head] resuming at step {prev['step']} ({prev['minutes']:.1f} of {cfg.minutes} minutes)")
    else:
        counts = torch.zeros(V, dtype=torch.long)
        for x, a in zip(store.ids, store.answer):
            counts += torch.bincount(x[a], minlength=V)[:V]
        vocab = draft_vocab_from_counts(counts, K, list(dllm.eos_token_ids), list(dllm.never_generate_ids))
        coverage = float(counts[vocab].sum()) / max(1, int(counts.sum()))
        hcfg = DraftHeadConfig.from_verifier(model.config, dllm.mask_token_id, window=cfg.window,
                                             draft_vocab_size=K, num_layers=cfg.num_layers,
                                             max_drafts=cfg.max_drafts)
        head = DraftHead(hcfg, vocab)
        decoder = model.base_model
        head.init_from_verifier(decoder.layers[-1].state_dict(), getattr(decoder, "norm", None).weight
                                if hasattr(decoder, "norm") else None)
        log(f"[train-head] draft vocabulary: {K} ids cover {coverage:.1%} of the answer tokens")
        prev = {"step": 0, "minutes": 0.0, "key": FeatureStore.key(cfg), "coverage": coverage}

    embedding = model.get_input_embeddings().weight.detach()
    lm_rows = model.get_output_embeddings().weight.detach()[head.draft_vocab].float()
    vocab_index = torch.full((V,), -1, dtype=torch.long)
    vocab_index[head.draft_vocab] = torch.arange(K)

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    opt_f = state_dir / "optimizer.pt"
    if prev["step"] and opt_f.is_file():
        opt.load_state_dict(torch.load(opt_f, weights_only=True))
    clock = BudgetClock(prev["minutes"], cfg.minutes)
    sched = make_scheduler(opt, "cosine_time", cfg.warmup, 0, clock)
    for _ in range(prev["step"]):
        sched.step()
    rng = random.Random(cfg.seed * 1_000_003 + prev["step"])
    metrics_f = state_dir / "metrics.csv"
    new_csv = not metrics_f.is_file()
    step = prev["step"]
    clock.start()
    t_start = time.perf_counter()

    def save() -> None:
        head.save(head_dir)
        tmp = opt_f.with_name(f".{opt_f.name}.tmp-{unique_suffix()}")
        torch.save(opt.state_dict(), tmp)
        os.replace(tmp, opt_f)
        minutes = prev["minutes"] + (time.perf_counter() - t_start) / 60.0
        _atomic_json(state_f, {**prev, "step": step, "minutes": minutes, "config": dataclasses.asdict(cfg)})

    order = list(range(len(store)))
    random.Random(cfg.seed).shuffle(order)
    n_val = min(cfg.val_docs, len(order) // 5)  # held-out documents: never trained on, scored at every save
    val_idx, train_idx = order[:n_val], order[n_val:]

    def validate() -> None:
        if not val_idx:
            return
        vrng = random.Random(12345)  # the same anchors and masks at every save
        tot = {"loss": 0.0, "first": 0.0, "later": 0.0, "n": 0}
        head.eval()
        with torch.no_grad():
            for s in range(0, len(val_idx), cfg.batch_size):
                vb = build_batch(store, val_idx[s: s + cfg.batch_size], cfg, dllm.mask_token_id, vocab_index, vrng)
                vloss, vst = head_loss(head, vb, embedding, lm_rows)
                tot["loss"] += float(vloss)
                tot["first"] += vst["acc_first"]
                tot["later"] += vst["acc_later"]
                tot["n"] += 1
        head.train()
        k = max(1, tot["n"])
        row = [step, f"{tot['loss'] / k:.4f}", f"{tot['first'] / k:.4f}", f"{tot['later'] / k:.4f}"]
        val_f = state_dir / "val.csv"
        fresh = not val_f.is_file()
        with open(val_f, "a", newline="") as vf:
            vw = csv.writer(vf)
            if fresh:
                vw.writerow(["step", "val_loss", "val_acc_first", "val_acc_later"])
            vw.writerow(row)
        log(f"[train-head] step {step} held-out ({len(val_idx)} documents): loss {row[1]} first-draft acc {row[2]} "
            f"later-draft acc {row[3]}")

    with open(metrics_f, "a", newline="") as fh:
        w = csv.writer(fh)
        if new_csv:
            w.writerow(["step", "minutes", "lr", "loss", "acc_first", "acc_later", "targets", "sec_per_step"])
        while True:
            done_time = cfg.minutes > 0 and clock.fraction() >= 1.0
            done_steps = cfg.max_steps > 0 and step >= cfg.max_steps
            if done_time or done_steps:
                break
            t0 = time.perf_counter()
            idx = [train_idx[rng.randrange(len(train_idx))] for _ in range(cfg.batch_size)]
            batch = build_batch(store, idx, cfg, dllm.mask_token_id, vocab_index, rng)
            loss, stats = head_loss(head, batch, embedding, lm_rows)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            loss = loss.detach()
            minutes = prev["minutes"] + (time.perf_counter() - t_start) / 60.0
            w.writerow([step, f"{minutes:.3f}", f"{sched.get_last_lr()[0]:.3e}", f"{float(loss):.4f}",
                        f"{stats['acc_first']:.4f}", f"{stats['acc_later']:.4f}", stats["targets"],
                        f"{time.perf_counter() - t0:.2f}"])
            fh.flush()
            if step % 10 == 0:
                log(f"[train-head] step {step} {minutes:.1f} min loss {float(loss):.3f} first-draft acc "
                    f"{stats['acc_first']:.3f} later-draft acc {stats['acc_later']:.3f}")
            if step % cfg.save_every == 0:
                save()
                validate()
    save()
    if step % cfg.save_every:  # not scored by the save in the loop already
        validate()
    log(f"[train-head] done: {step} steps; serve with `unmask serve {out}` (speculative requests draft with the head)")
    return out
