"""PARD / PARD-2: a small autoregressive draft LM that drafts K tokens in one pass through K - 1 mask tokens.

The draft is a plain Llama (its own embedding and head, the target's tokenizer and
vocabulary), converted by training on K copies of each sequence: copy 0 is the
text, copy i (1..K-1) holds the reserved `<|mask|>` id everywhere. The copy-i
query at position p sees the real tokens x_0..x_{p-i} and one mask per copy
j = 1..i at position p - i + j (itself included), all copies at positions
0..L-1, so it is the i-th mask after a prefix ending at x_{p-i} and its logit
predicts x_{p+1} (`copy_layout`; the model reads the layout chunk by chunk,
drafters/pard_attention.py). Conditional drop (COD, `cod_keep`) keeps copy 0
whole and, in copy i, int(L * max(r^i, r_min)) positions drawn among the
successors of those kept in copy i - 1, so every kept mask keeps its chain.

PARD-2 adds target features: the target's states at `target_layer_ids` are
concatenated, shifted right by one (x_t gets the state that predicted it, zeros
at t = 0), projected by `target_proj` (no bias) and scaled by 0.02 into the
input embeddings; mask tokens carry the last real token's feature. Training
zeros a whole sample's features with probability `sft.feature_drop`, which
trains the target-independent (TI) mode; with features off the model is the
plain draft LM (the projection has no bias), so one checkpoint serves both
modes: `target_dependent` picks the mode at decode time.

Training objective (`sft_loss`): 0.1 CE on the gold tokens + 1.0 forward KL to
the target's distribution, each a weighted mean with CAT weights: the label i
copies past its context weighs the product of the target's probabilities of the
i gold tokens in between (no gradient), as published.

On the shared (row, depth) grid of drafters/base.py, row t, depth d is the
copy-d logit at p = t + 1 + d (context x_0..x_{t+1}); PARD never reads its own
drafts, so `depth_tokens` is ignored.

Checkpoint: a Hugging Face Llama directory (`LlamaForCausalLM`, tensors named as
Hugging Face names them) whose config.json carries `pard_token` (the mask id, as
vLLM's parallel drafting reads it) and `pard_config` (target layer ids in this
project's convention, the target width, the feature scale), plus
`target_proj.weight`.

Serving: vLLM runs the TI mode as `method: draft_model` with `parallel_drafting`
(the draft LM alone, its own embedding and head, the target's tokenizer).
`export` writes that directory: the checkpoint without `target_proj.weight`,
marked `pard_config.target_dependent: false`; it loads here too, as a TI-only
drafter. The TD mode has no stock vLLM method, so a directory that still holds
the projection is refused for serving.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from draftopd.divergences import cat_weights
from draftopd.drafters.base import Pick, pick_block
from draftopd.drafters.pard_attention import ATTENTION, layout, layout_rows, register_attention
from draftopd.models.layers import at_least_fp32

ARCHITECTURE = "LlamaForCausalLM"
FORMATS = ("vllm",)  # vLLM's draft_model with parallel_drafting: the target-independent mode
TD_REFUSAL = (
    "PARD's target-dependent mode has no stock vLLM method (draft_model with parallel_drafting reads no target "
    "features): serve the target-independent mode that `draftopd export --format vllm` writes, or decode the "
    "target-dependent mode with --backend native"
)
FEAT_SCALE = 0.02  # PARD-2's published scale of the projected target features
LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
)


# ---- the published training layout ---------------------------------------------------------------


def cod_keep(length: int, num_copies: int, ratio: float, minimum: float, generator=None) -> list[torch.Tensor]:
    """Positions kept in each copy: copy 0 whole; copy i keeps n_i = int(L * max(r^i, r_min)) (at most the
    candidates) drawn uniformly among (kept in copy i - 1) + 1 mod L, so a kept mask's whole chain is kept."""
    kept = [torch.arange(length)]
    for i in range(1, num_copies):
        cand = (kept[-1] + 1) % length
        n = min(int(length * max(ratio**i, minimum)), cand.numel())
        kept.append(cand[torch.randperm(cand.numel(), generator=generator)[:n]].sort().values)
    return kept


def copy_layout(kept: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(copy [T], position [T], mask [T, T]) of the kept tokens of all copies, concatenated copy by copy.

    mask[a, b]: query a may attend key b (`pard_attention.layout_rows`); the model is given the layout, not this
    mask, and builds its rows chunk by chunk.
    """
    copy, pos = copy_positions(kept)
    return copy, pos, layout_rows(copy, pos, 0, len(pos))


def copy_positions(kept: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(copy [T], position [T]) of the kept tokens of all copies, concatenated copy by copy."""
    return torch.cat([torch.full_like(k, i) for i, k in enumerate(kept)]), torch.cat(kept)


# ---- the model --------------------------------------------------------------------------------------


def target_independent_only(raw: dict) -> bool:
    """Whether a config.json is an export for vLLM (no `target_proj`: the TI mode only)."""
    return (raw.get("pard_config") or {}).get("target_dependent", True) is False


def llama_config(d: dict):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{k: d[k] for k in LLAMA_KEYS if d.get(k)}, tie_word_embeddings=False)
    rope = (d.get("rope_parameters") or {}).get("rope_theta") or d.get("rope_theta") or 10000.0
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(rope)}
    return cfg


class PardDrafter(nn.Module):
    """A Llama draft LM (`lm`) plus PARD-2's feature projection; `target_dependent` picks the decode mode."""

    def __init__(self, lm, mask_token_id: int, aux_layer_ids: list[int], target_hidden_size: int):
        super().__init__()
        cfg = lm.config
        if not 0 <= mask_token_id < cfg.vocab_size:
            raise ValueError(f"pard_token {mask_token_id} is outside the vocabulary of {cfg.vocab_size}")
        register_attention()
        lm.config._attn_implementation = ATTENTION  # sdpa, chunked over the copies' layout
        self.lm = lm
        self.mask_token_id = mask_token_id
        self._aux = list(aux_layer_ids)
        self.target_hidden_size = target_hidden_size
        self.target_proj = nn.Linear(len(aux_layer_ids) * target_hidden_size, cfg.hidden_size, bias=False)
        self.target_dependent = True  # a decode-time choice, not saved: features off is the TI mode

    @property
    def lm_head(self) -> nn.Module:
        return self.lm.lm_head

    def run(self, ids, positions, mask, feats=None) -> torch.Tensor:
        """Logits [B, T, V] of tokens `ids` at `positions` under the boolean `mask` [B, T, T] (True: attend) or
        the copies' layout [B, T, 3] (`pard_attention.layout`, the mask built chunk by chunk);
        `feats` [B, T, F] are already shifted and placed (None: the target-independent mode)."""
        x = self.lm.get_input_embeddings()(ids)
        if feats is not None:
            x = x + FEAT_SCALE * self.target_proj(feats.to(x.dtype))
        return self.lm(inputs_embeds=x, position_ids=positions, attention_mask=mask[:, None]).logits

    def copies(self, input_ids, features, valid, kept: list[torch.Tensor]):
        """Logits [B, T, V] and (copy, position) [T] of the kept tokens of every copy (see `copy_layout`)."""
        dev = input_ids.device
        kept = [k.to(dev) for k in kept]
        copy, pos = copy_positions(kept)
        real_pos = pos.clamp_max(input_ids.shape[1] - 1)  # masks may sit past the text's end (not real tokens)
        ids = torch.where(
            copy == 0, input_ids[:, real_pos], torch.full_like(input_ids[:, real_pos], self.mask_token_id)
        )
        base = pos - copy
        # Keys: real tokens only where valid; every query keeps itself (the attention's rule), so no row is empty.
        key_ok = (copy != 0)[None] | valid[:, real_pos]
        mask = layout(copy, pos, key_ok)
        feats = None
        if features is not None:  # copy i at p carries the (shifted) feature of its last real token x_{p-i}
            feats = features[:, base.clamp_min(0)] * (base >= 0)[None, :, None].to(features.dtype)
        return self.run(ids, pos.expand(input_ids.shape[0], -1), mask, feats), copy, pos

    # ---- the family interface (drafters/base.py) ------------------------------

    kind: ClassVar[str] = "pard"

    @staticmethod
    def max_drafts(cfg) -> int | None:
        """Any K: the mask copies are built for the K asked."""
        return None

    @staticmethod
    def config_refusal(cfg) -> str:
        """Why a resolved recipe cannot run with this family ('' when it can). vLLM's draft model takes PARD pushes
        (tests/test_pard_vllm.py), but only in the TI mode, and the drafter Draft-OPD trains holds `target_proj`
        (the TD mode, which no stock vLLM method runs): its rollouts would decode another policy."""
        if cfg.opd.enabled and cfg.rollout.backend == "vllm":
            return (
                "Draft-OPD trains PARD's target-dependent mode, which vLLM's draft model does not run (TI only): "
                "rollout.backend=native with drafter.kind=pard"
            )
        return ""

    @property
    def needs(self) -> str:
        return "aux" if self.target_dependent else "none"

    @property
    def vocab_size(self) -> int:
        return self.lm.config.vocab_size

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self._aux)

    def draft_to_target_ids(self) -> torch.Tensor:
        """The whole target vocabulary: the draft LM has the target's tokenizer."""
        return torch.arange(self.vocab_size, device=self.target_proj.weight.device)

    def proposer(self) -> PardProposer:
        return PardProposer(self)

    def features(self, out) -> torch.Tensor | None:
        """The target states shifted right by one (x_t gets the state at t - 1, zeros at t = 0); None in TI."""
        if not self.target_dependent:
            return None
        aux = out.aux_hidden.to(self.target_proj.weight.dtype)
        return torch.cat([torch.zeros_like(aux[:, :1]), aux[:, :-1]], 1)

    def score(self, input_ids, features, valid, depth: int, depth_tokens=None, rows=None) -> torch.Tensor:
        """Logits [B, depth, n, V]: row t, depth d is the copy-d logit at p = t + 1 + d, for every row: copy d
        runs at p = d + 1 .. L - 1 + d, past the text's end too (its context x_0..x_{t+1} is always real), as a
        rollout drafts past the end of what it later emits.

        `rows` [B, R] (the same in every batch row: the copies are laid out once): [B, depth, R, V], the mask
        copies kept only at those rows' blocks. A mask sees the real tokens and its own chain alone, all kept, so
        each row's logits are the full grid's."""
        length = input_ids.shape[1]
        if rows is None:  # every row: copy d >= 1 at p = d + 1 .. L - 1 + d
            rows = torch.arange(length - 1, device=input_ids.device)
        elif bool((rows != rows[:1]).any()):
            raise ValueError("PARD scores the same rows in every batch row (its copies are laid out once)")
        else:
            rows = rows[0]
        kept = [torch.arange(length, device=rows.device)] + [rows + 1 + d for d in range(1, depth)]
        logits, _, _ = self.copies(input_ids, features, valid, kept)
        r = len(rows)  # copy 0 holds all L tokens (the context; its logit at t + 1 is row t's), copy d >= 1 holds R
        parts = [logits[:, rows + 1]] + [logits[:, length + (d - 1) * r : length + d * r] for d in range(1, depth)]
        return torch.stack(parts, 1)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """`score`, so that wrappers such as a DeepSpeed engine can call the module."""
        return self.score(*args, **kwargs)

    def sft_loss(self, batch, out, depth: int, cfg, generator=None) -> tuple[torch.Tensor, dict]:
        """PARD-2's objective on K = `depth` copies: COD-kept tokens, per-sample feature drop, CAT weights,
        `cfg.ce_weight` x CE + `cfg.kd_weight` x KL(target || draft), each sum(w l) / sum(w)."""
        ids, length = batch.input_ids, batch.input_ids.shape[1]
        features = self.features(out)
        if features is not None and cfg.feature_drop > 0:
            keep = torch.rand(ids.shape[0], generator=generator) >= cfg.feature_drop
            features = features * keep.to(features.device, features.dtype)[:, None, None]
        # One COD draw per batch (the reference is silent on per-sample draws): tensors stay rectangular.
        kept = cod_keep(length, depth, cfg.cod_ratio, cfg.cod_min, generator)
        logits, copy, pos = self.copies(ids, features, batch.valid, kept)
        # A label needs a real context (p >= i), a next token, and a response token there (`loss_pos`: the
        # final assistant turn, as PARD-2 trains). The reference's copy-i label at p = i - 1 has no real token
        # in its context; it is left out here (the reference notes do not say it is meant).
        nxt = (pos + 1).clamp_max(length - 1)
        use = (pos >= copy) & (pos + 1 < length)
        mask = batch.loss_pos[:, pos] & use[None]
        w = (
            cat_weights(out.logits, ids, depth)[:, copy, pos]
            if cfg.cat_weights
            else torch.ones_like(mask, dtype=logits.dtype)
        )
        w = w.to(logits.dtype) * mask
        logp = torch.log_softmax(logits.to(at_least_fp32(logits.dtype)), -1)
        teacher = torch.log_softmax(out.logits[:, pos].to(logp.dtype), -1)
        ce = -logp.gather(2, ids[:, nxt, None]).squeeze(2)
        kd = (teacher.exp() * (teacher - logp)).sum(-1)
        norm = w.sum().clamp_min(1e-12)
        ce_mean, kd_mean = (w * ce).sum() / norm, (w * kd).sum() / norm
        loss = cfg.ce_weight * ce_mean + cfg.kd_weight * kd_mean
        metrics = {"ce": ce_mean.item(), "kd": kd_mean.item(), "tokens": len(pos), "full_tokens": depth * length}
        agree = (logits.argmax(-1) == out.logits[:, pos].argmax(-1)).to(logits.dtype)
        for d in range(depth):
            at = mask & (copy == d)[None]
            if at.any():
                metrics[f"acc_{d}"] = float((agree * at).sum() / at.sum())
        return loss, metrics

    def config(self) -> dict:
        d = self.lm.config.to_dict()
        d.update(
            architectures=[ARCHITECTURE],
            model_type="llama",
            pard_token=self.mask_token_id,
            pard_config={
                "target_layer_ids": self.aux_layer_ids,  # this project's convention (models/target.py)
                "target_hidden_size": self.target_hidden_size,
                "feat_scale": FEAT_SCALE,
            },
        )
        d["dtype"] = d["torch_dtype"] = str(self.target_proj.weight.dtype).removeprefix("torch.")
        return d

    def state(self) -> dict[str, torch.Tensor]:
        return {**self.lm.state_dict(), "target_proj.weight": self.target_proj.weight}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """`state()`'s tensors (Hugging Face names) into this drafter in place, all of them."""
        lm_state = {k: v for k, v in state.items() if k != "target_proj.weight"}
        missing, unexpected = self.lm.load_state_dict(lm_state, strict=False)
        if missing or unexpected:
            raise ValueError(f"pard drafter: missing tensors {missing}, unexpected tensors {unexpected}")
        self.target_proj.load_state_dict({"weight": state["target_proj.weight"]})

    @classmethod
    def from_state(cls, config: dict, state: dict[str, torch.Tensor], target) -> PardDrafter:
        from transformers import LlamaForCausalLM

        cfg = cls.read_config(config)
        extra = cfg["pard_config"]
        ti_only = target_independent_only(cfg)
        if cfg["vocab_size"] != target.vocab_size:
            raise ValueError(f"built for vocabulary {cfg['vocab_size']}, the target has {target.vocab_size}")
        if extra["target_layer_ids"] != target.aux_layer_ids or extra["target_hidden_size"] != target.hidden_size:
            raise ValueError(
                f"reads target layers {extra['target_layer_ids']} of width {extra['target_hidden_size']}, "
                f"target set to {target.aux_layer_ids} of width {target.hidden_size}"
            )
        drafter = cls(
            LlamaForCausalLM(llama_config(cfg)), cfg["pard_token"], extra["target_layer_ids"], target.hidden_size
        )
        lm_state = {k: v for k, v in state.items() if k != "target_proj.weight"}
        missing, unexpected = drafter.lm.load_state_dict(lm_state, strict=False)
        if ("target_proj.weight" not in state and not ti_only) or missing or unexpected:
            raise ValueError(f"PARD weights: missing {missing or ['target_proj.weight']}, unexpected {unexpected}")
        if ti_only:  # an export for vLLM: a zero projection makes both modes the plain draft LM
            nn.init.zeros_(drafter.target_proj.weight)
            drafter.target_dependent = False
        else:
            drafter.target_proj.load_state_dict({"weight": state["target_proj.weight"]})
        return drafter.to(target.dtype)

    @staticmethod
    def target_layers(config: dict) -> list[int]:
        return list(PardDrafter.read_config(config)["pard_config"]["target_layer_ids"])

    @staticmethod
    def speculative_config(path, num_draft_tokens: int) -> dict:
        """vLLM's config serving an exported directory (the TI mode); the mask id is the config's `pard_token`."""
        raw = json.loads((Path(path) / "config.json").read_text())
        if "pard_config" in raw and not target_independent_only(raw):
            raise ValueError(TD_REFUSAL)
        return {
            "method": "draft_model",
            "model": str(path),
            "num_speculative_tokens": num_draft_tokens,
            "parallel_drafting": True,
        }

    # ---- layouts and construction ------------------------------------------------

    formats: ClassVar[tuple[str, ...]] = FORMATS
    scores_rows: ClassVar[bool] = True  # a mask sees the real tokens and its own chain: rows are independent
    learner_context: ClassVar[int] = 2048  # reads its tokens alone: a cut prompt misleads it (docs/serving.md)
    live_push: ClassVar[bool] = True  # through vLLM's weight-transfer calls (tests/test_pard_vllm.py pushes, decodes)

    @staticmethod
    def read_config(raw: dict) -> dict:
        if "pard_token" not in raw or "pard_config" not in raw:
            raise ValueError("a 'pard' config.json needs pard_token and pard_config (target layer ids and width)")
        return raw

    @staticmethod
    def export(config: dict, tensors: dict, fmt: str, verifier: str = "", num_draft_tokens: int = 4):
        """(config.json, tensors) of the TI mode for vLLM: the draft LM alone, marked target-independent."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown PARD format {fmt!r}: {', '.join(FORMATS)} (the target-independent mode)")
        cfg = PardDrafter.read_config(config)
        out = {**cfg, "pard_config": {**cfg["pard_config"], "target_dependent": False}}
        out.pop("mask_token_id", None)  # vLLM reads a top-level mask_token_id before pard_token
        return out, {k: v for k, v in tensors.items() if k != "target_proj.weight"}

    @staticmethod
    def describe(raw: dict, tensors: dict, target=None) -> list[str]:
        """What `draftopd inspect` prints about a checkpoint."""
        cfg = PardDrafter.read_config(raw)
        extra = cfg["pard_config"]
        modes = "TI only (vLLM: draft_model, parallel_drafting)" if target_independent_only(cfg) else "TD and TI"
        lines = [
            f"layout: Hugging Face {ARCHITECTURE} with pard_token {cfg['pard_token']} (parallel drafting)",
            f"modes: {modes}",
            f"layers: {cfg['num_hidden_layers']} x hidden {cfg['hidden_size']}, vocabulary {cfg['vocab_size']}",
            f"target features: layers {extra['target_layer_ids']} x {extra['target_hidden_size']}, "
            f"scale {extra['feat_scale']}",
            f"parameters: {sum(t.numel() for t in tensors.values()):,}",
        ]
        if target is not None:
            fits = cfg["vocab_size"] == target.vocab_size and extra["target_layer_ids"] == target.aux_layer_ids
            lines.append(f"fits the target: {'yes' if fits else 'no'}")
        return lines

    @classmethod
    def new(cls, cfg, target, draft_to_target: torch.Tensor) -> PardDrafter:
        """A drafter from the recipe's `drafter` section: the AR draft LM in `drafter.base_lm` (PARD converts an
        existing draft LM), or a random Llama of the section's shape when it is empty (tests)."""
        from transformers import LlamaForCausalLM

        if cfg.mask_token_id < 0:
            raise ValueError("drafter.mask_token_id must name an unused vocabulary row (the tokenizer's <|mask|>)")
        if cfg.base_lm:
            from draftopd.loading import resolve_draft_lm

            lm = LlamaForCausalLM.from_pretrained(resolve_draft_lm(cfg.base_lm), dtype=target.dtype)
        else:
            hidden = cfg.hidden_size or target.hidden_size
            shape = {
                "hidden_size": hidden,
                "intermediate_size": cfg.intermediate_size or 3 * hidden,
                "num_hidden_layers": cfg.num_hidden_layers,
                "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_key_value_heads,
                "head_dim": cfg.head_dim,
                "vocab_size": target.vocab_size,
                "rope_theta": target.rope_theta,
            }
            lm = LlamaForCausalLM(llama_config(shape))
        if lm.config.vocab_size != target.vocab_size:
            raise ValueError(f"draft LM vocabulary {lm.config.vocab_size} is not the target's {target.vocab_size}")
        # target_proj keeps nn.Linear's default initialisation (the reference notes are silent on it).
        return cls(lm, cfg.mask_token_id, list(target.aux_layer_ids), target.hidden_size).to(target.dtype)


class PardProposer:
    """PARD inference state of one decode call (drafters/base.py `Proposer`).

    Committed tokens are kept as slot arrays (ids, positions, validity and, in the TD mode, their shifted
    features); each step runs the draft over [committed, pending, mask x (K - 1)] in one pass, recomputed
    from scratch (the same outputs as rolling back a cache), and takes the argmax or a sample at the last K.
    """

    def __init__(self, drafter: PardDrafter):
        self.d = drafter
        self.td = drafter.target_dependent

    def begin(self, ids, positions, valid, first, out) -> None:
        self.ids, self.pos, self.valid = ids, positions, valid
        self.pending, self.pending_pos = first, positions[:, -1] + 1
        if self.td:
            aux = out.aux_hidden.to(self.d.target_proj.weight.dtype)
            prev = torch.cat([torch.zeros_like(aux[:, :1]), aux[:, :-1] * valid[:, :-1, None]], 1)
            self.feat, self.last_feat = prev, aux[:, -1]

    def propose(self, k: int, pick: Pick):
        b, s = self.ids.shape
        dev = self.ids.device
        ids = torch.cat([self.ids, self.pending[:, None], torch.full((b, k - 1), self.d.mask_token_id, device=dev)], 1)
        positions = torch.cat([self.pos, self.pending_pos[:, None] + torch.arange(k, device=dev)], 1)
        ok = torch.cat([self.valid, torch.ones(b, k, dtype=torch.bool, device=dev)], 1)
        t = s + k
        eye = torch.eye(t, dtype=torch.bool, device=dev)
        mask = (torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None] & ok[:, None, :]) | eye[None]
        feats = None
        if self.td:  # the pending token and its masks carry the state that predicted the pending token
            feats = torch.cat([self.feat, self.last_feat[:, None].expand(-1, k, -1)], 1)
        logits = self.d.run(ids, positions, mask, feats)[:, s:].reshape(b * k, -1)
        return pick_block(logits, b, k, pick)

    def commit(self, out, emitted, num_emitted, positions) -> None:
        """[pending, accepted drafts] become committed slots; the correction or bonus token is the next pending."""
        m = int(num_emitted.max())
        rows = torch.arange(emitted.shape[0], device=emitted.device)
        new_ids = torch.cat([self.pending[:, None], emitted[:, : m - 1]], 1)
        new_valid = torch.arange(m, device=emitted.device)[None] < num_emitted[:, None]
        self.ids = torch.cat([self.ids, new_ids], 1)
        self.pos = torch.cat([self.pos, positions[:, :m]], 1)
        self.valid = torch.cat([self.valid, new_valid], 1)
        if self.td:
            aux = out.aux_hidden.to(self.feat.dtype)
            self.feat = torch.cat([self.feat, self.last_feat[:, None], aux[:, : m - 1]], 1)
            self.last_feat = aux[rows, num_emitted - 1]
        self.pending = emitted[rows, num_emitted - 1]
        self.pending_pos = positions[:, 0] + num_emitted

    def select(self, keep: torch.Tensor) -> None:
        self.ids, self.pos, self.valid = self.ids[keep], self.pos[keep], self.valid[keep]
        self.pending, self.pending_pos = self.pending[keep], self.pending_pos[keep]
        if self.td:
            self.feat, self.last_feat = self.feat[keep], self.last_feat[keep]
