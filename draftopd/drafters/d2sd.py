"""D²SD: a DFlash block drafter plus a variable-prefix (VP) drafter that re-drafts at likely rejection points.

Each step the *first* drafter (a DFlash drafter, drafters/dflash.py) drafts one
block greedily, with confidences c_k (its probability of its own k-th token).
The boundary score r(i) = prod_{k<=i} c_k * (1 - c_{i+1}) is the chance that
exactly i drafts pass if the c_k were independent; the `num_candidates` best
boundaries are kept. For each, the *VP* drafter (the same architecture, its own
weights) sees the anchor and the first i drafts as real text and fills the rest
of its block; all such rows go through it in one batched pass. The engine then
verifies [first block, VP rows] in one target pass with cascade attention and
accepts along the first row that still agrees with what the target emitted
(engine/cascade.py, engine/verify.py). Drafts are argmax at every temperature,
as published; with fixed drafts, "the target samples, a row survives while it
agrees" is exact.

Training (SFT, sft/trainer.py): at the random anchors the trainer draws, the
first drafter learns DFlash's blocks and the VP drafter the same anchors seen
with a visible prefix of i tokens (anchor included), i drawn with
P(i) proportional to `vp_prefix_base ** i` over 1..B-1, the loss on offsets
k >= i weighted exp(-(k - i) / gamma) (`sft.depth_decay` = exp(-1 / gamma)
at depth d = k - i). The published VP code draws i from 2..B-1; the paper's
rule, followed here, also keeps i = 1, which inference uses at boundary 0.

Checkpoint layout (one directory, written and read by drafters/__init__.py):
config.json = {"architectures": ["D2SDDraftModel"], "model_type": "d2sd",
"num_candidates": K, "vp_prefix_base": 0.9, "first_drafter": <the first
drafter's DFlash config.json>, "vp_drafter": <the VP drafter's>};
model.safetensors holds the first drafter's tensors under "first." and the VP
drafter's under "vp.", each named as in a DFlash checkpoint. No serving engine
runs D²SD yet, so there is no export format.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from draftopd.drafters.base import Pick, RowSet
from draftopd.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashProposer
from draftopd.models.layers import at_least_fp32

ARCHITECTURE = "D2SDDraftModel"
PARTS = ("first", "vp")


def boundary_scores(conf: torch.Tensor) -> torch.Tensor:
    """r(i) = prod_{k<=i} c_k * (1 - c_{i+1}) for i = 0..K-1 from confidences conf [B, K] (c_1..c_K)."""
    survive = torch.cat([torch.ones_like(conf[:, :1]), conf[:, :-1]], 1).cumprod(1)  # prod_{k<=i} c_k
    return survive * (1 - conf)


def top_boundaries(conf: torch.Tensor, num: int) -> torch.Tensor:
    """The `num` best boundaries [B, num] by r(i), in increasing order of i."""
    best = boundary_scores(conf).topk(min(num, conf.shape[1]), dim=1).indices
    return best.sort(1).values


def prefix_score(vp: DFlashDrafter, input_ids, features, valid, depth: int, rows, prefix) -> torch.Tensor:
    """VP logits [B, depth, R, V] on the shared grid: row t shows tokens t + 2 - i .. t + 1 (i = prefix [B, R]
    visible tokens, the first of them the anchor) and depth d predicts token t + 2 + d, block offset i + d.
    Depths d >= block - i fall outside the block; they repeat its last offset and carry no loss."""
    b, n = input_ids.shape
    bk = vp.cfg.block_size
    anchor = rows + 2 - prefix
    offsets = torch.arange(bk, device=input_ids.device)
    at = (anchor[..., None] + offsets).clamp(0, n - 1)
    ids = input_ids.gather(1, at.flatten(1)).view(*rows.shape, bk)
    ids = torch.where(offsets < prefix[..., None], ids, torch.full_like(ids, vp.cfg.mask_token_id))
    positions = torch.arange(n, device=input_ids.device)
    ctx_kv = vp.context(features, positions.expand(b, -1))
    visible = (positions[None, None] < anchor[..., None]) & valid[:, None, :]
    hidden = vp.run_blocks(ids, anchor, ctx_kv, visible)
    at_depth = (prefix[..., None] + torch.arange(depth, device=input_ids.device)).clamp_max(bk - 1)
    picked = hidden.gather(2, at_depth[..., None].expand(-1, -1, -1, hidden.shape[-1]))
    return vp.logits(picked).transpose(1, 2)


class D2SDDrafter(nn.Module):
    """The first (DFlash) drafter and the VP drafter, both bound to the target's embedding and head."""

    def __init__(self, first: DFlashDrafter, vp: DFlashDrafter, num_candidates: int = 4, vp_prefix_base: float = 0.9):
        super().__init__()
        a, b = first.cfg, vp.cfg
        if (a.vocab_size, a.hidden_size, a.aux_layer_ids) != (b.vocab_size, b.hidden_size, b.aux_layer_ids):
            raise ValueError("the first and VP drafters must read the same target (vocabulary, width, layers)")
        if b.block_size < a.block_size:
            raise ValueError(f"the VP block ({b.block_size}) must hold the first drafter's ({a.block_size})")
        if num_candidates < 1 or not 0 < vp_prefix_base:
            raise ValueError("num_candidates must be >= 1 and vp_prefix_base > 0")
        self.first, self.vp = first, vp
        self.num_candidates, self.vp_prefix_base = num_candidates, vp_prefix_base

    # ---- the family interface (drafters/base.py) ------------------------------

    kind: ClassVar[str] = "d2sd"
    needs: ClassVar[str] = "aux"

    @staticmethod
    def max_drafts(cfg) -> int | None:
        """Drafts per step: the first drafter's block, block_size - 1. `cfg`: anything with a `block_size` (the
        recipe's drafter section, a built drafter)."""
        return cfg.block_size - 1

    @staticmethod
    def config_refusal(cfg) -> str:
        """Why a resolved recipe cannot run with this family ('' when it can)."""
        if cfg.opd.enabled:
            return "drafter.kind=d2sd: Draft-OPD does not replay D²SD steps yet (a winning row mixes both drafters)"
        return ""

    @property
    def block_size(self) -> int:
        """The first drafter's block (the VP drafter's holds at least as many)."""
        return self.first.cfg.block_size

    @property
    def vocab_size(self) -> int:
        return self.first.vocab_size

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.first.aux_layer_ids

    def draft_to_target_ids(self) -> torch.Tensor:
        return self.first.draft_to_target_ids()

    def proposer(self) -> D2SDProposer:
        return D2SDProposer(self)

    def features(self, out) -> torch.Tensor:
        return self.first.features(out)

    def score(self, input_ids, features, valid, depth: int, depth_tokens=None, rows=None, prefix=None):
        """The first drafter's grid (DFlash's `score`), or with `prefix` [B, R] the VP drafter's at `rows`."""
        if depth_tokens is not None:
            raise ValueError(
                "replaying D²SD steps (Draft-OPD) is not implemented: a winning row mixes both drafters' tokens"
            )
        if prefix is None:
            return self.first.score(input_ids, features, valid, depth, rows=rows)
        return prefix_score(self.vp, input_ids, features, valid, depth, rows, prefix)

    def training_rows(self, rows: torch.Tensor, real: torch.Tensor, generator=None) -> dict[str, RowSet]:
        """DFlash rows at the drawn anchors for the first drafter; the same anchors with a random visible prefix
        for the VP drafter (metrics prefixed `vp_`)."""
        bk = self.vp.cfg.block_size
        lengths = torch.arange(1, bk, dtype=torch.float64)
        weights = (self.vp_prefix_base**lengths).expand(rows.numel(), -1)
        i = torch.multinomial(weights, 1, generator=generator).view(rows.shape).to(rows.device) + 1
        vp = RowSet(rows + i - 1, real, num_depths=bk - i, kwargs={"prefix": i})
        return {"": RowSet(rows, real), "vp_": vp}

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.score(*args, **kwargs)

    def config(self) -> dict:
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "d2sd",
            "num_candidates": self.num_candidates,
            "vp_prefix_base": self.vp_prefix_base,
            "first_drafter": self.first.config(),
            "vp_drafter": self.vp.config(),
        }

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())

    @classmethod
    def from_state(cls, config: dict, state: dict[str, torch.Tensor], target) -> D2SDDrafter:
        parts = {}
        for name in PARTS:
            mine = {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(name + ".")}
            parts[name] = DFlashDrafter.from_state(config[f"{name}_drafter"], mine, target)
        stray = [k for k in state if k.split(".", 1)[0] not in PARTS]
        if stray:
            raise ValueError(f"D²SD weights: unexpected {stray}")
        return cls(parts["first"], parts["vp"], config["num_candidates"], config["vp_prefix_base"])

    @staticmethod
    def target_layers(config: dict) -> list[int]:
        return list(DFlashConfig.from_hf(D2SDDrafter.read_config(config)["first_drafter"]).aux_layer_ids)

    @staticmethod
    def speculative_config(path, num_draft_tokens: int) -> dict:
        raise ValueError("no serving engine runs D²SD yet: decode it with the native engine (--backend native)")

    # ---- layouts and construction ------------------------------------------------

    formats: ClassVar[tuple[str, ...]] = ()
    scores_rows: ClassVar[bool] = False  # Draft-OPD does not replay D²SD
    learner_context: ClassVar[int] = 256  # not replayed by Draft-OPD; the window of those that are
    live_push: ClassVar[bool] = False  # not served by vLLM

    @staticmethod
    def read_config(raw: dict) -> dict:
        for name in PARTS:
            if not isinstance(raw.get(f"{name}_drafter"), dict):
                raise ValueError(f"a 'd2sd' config.json needs {name}_drafter (a DFlash config.json)")
            DFlashConfig.from_hf(raw[f"{name}_drafter"])
        if "num_candidates" not in raw or "vp_prefix_base" not in raw:
            raise ValueError("a 'd2sd' config.json needs num_candidates and vp_prefix_base")
        return raw

    @staticmethod
    def export(config: dict, tensors: dict, fmt: str, verifier: str = "", num_draft_tokens: int = 4):
        raise ValueError("D²SD has no serving layout to export to yet")

    @staticmethod
    def describe(raw: dict, tensors: dict, target=None) -> list[str]:
        D2SDDrafter.read_config(raw)
        lines = [f"layout: draftopd's {ARCHITECTURE} (a DFlash first drafter and a variable-prefix drafter)"]
        lines.append(f"candidates: {raw['num_candidates']} re-drafted boundaries per step")
        for name in PARTS:
            mine = {k: v for k, v in tensors.items() if k.startswith(name + ".")}
            sub = DFlashDrafter.describe(raw[f"{name}_drafter"], mine, target)
            lines += [f"{name}: {line}" for line in sub[1:]]
        return lines

    @classmethod
    def new(cls, cfg, target, draft_to_target: torch.Tensor) -> D2SDDrafter:
        """Two fresh DFlash drafters of the recipe's `drafter` shape (their initial weights differ)."""
        first = DFlashDrafter.new(cfg, target, draft_to_target)
        vp = DFlashDrafter.new(cfg, target, draft_to_target)
        return cls(first, vp, cfg.num_candidates, cfg.vp_prefix_base)


class D2SDProposer:
    """D²SD inference state of one decode call: each drafter keeps its own context keys and values.

    `propose_rows` is what the engine calls (drafters/base.py `RowProposer`); `propose` drafts the first
    drafter's block alone.
    """

    def __init__(self, drafter: D2SDDrafter):
        self.d = drafter
        self.first, self.vp = DFlashProposer(drafter.first), DFlashProposer(drafter.vp)

    def begin(self, ids, positions, valid, first, out) -> None:
        self.first.begin(ids, positions, valid, first, out)
        self.vp.begin(ids, positions, valid, first, out)

    def propose(self, k: int, pick: Pick):
        return self.first.propose(k, pick)

    def propose_rows(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [B, R, K] of argmax drafts and their drafters' log-probs [B, R, K]: row 0 is the first drafter's
        block, row j >= 1 keeps its first i_j drafts and takes the VP drafter's after them."""
        d, p = self.d, self.first
        if k > d.max_drafts(d):
            raise ValueError(f"{k} drafts per step, but a D²SD block of {d.block_size} holds fewer")
        hidden = d.first.blocks(p.anchor[:, None], p.anchor_pos[:, None], p.kv, p.valid[:, None])
        logits = d.first.logits(hidden[:, 0, 1 : k + 1])  # [B, K, V]
        logp, tokens = torch.log_softmax(logits.to(at_least_fp32(logits.dtype)), -1).max(-1)
        bounds = top_boundaries(logp.exp(), d.num_candidates)  # [B, M]
        b, m = bounds.shape
        bk = d.vp.cfg.block_size
        offset = torch.arange(bk, device=tokens.device)
        seen = torch.cat([p.anchor[:, None], tokens, tokens.new_zeros(b, bk - 1 - k)], 1)  # block offsets 0..bk-1
        mask = torch.full_like(seen[:, None], d.vp.cfg.mask_token_id)
        ids = torch.where(offset <= bounds[..., None], seen[:, None], mask)  # anchor + i_j drafts visible
        anchor_pos = p.anchor_pos[:, None].expand(b, m)
        v_hidden = d.vp.run_blocks(ids, anchor_pos, self.vp.kv, self.vp.valid[:, None])
        v_logits = d.vp.logits(v_hidden[:, :, 1 : k + 1])  # [B, M, K, V]
        v_logp, v_tokens = torch.log_softmax(v_logits.to(at_least_fp32(v_logits.dtype)), -1).max(-1)
        kept = torch.arange(k, device=tokens.device) < bounds[..., None]  # draft j < i_j: the first drafter's
        rows = torch.where(kept, tokens[:, None], v_tokens)
        row_logps = torch.where(kept, logp[:, None], v_logp)
        return torch.cat([tokens[:, None], rows], 1), torch.cat([logp[:, None], row_logps], 1)

    def commit(self, out, emitted, num_emitted, positions) -> None:
        self.first.commit(out, emitted, num_emitted, positions)
        self.vp.commit(out, emitted, num_emitted, positions)

    def select(self, keep: torch.Tensor) -> None:
        self.first.select(keep)
        self.vp.select(keep)
