"""Device check, section 1: the native engine's greedy output equals the target's own, with every drafter.

Greedy speculative decoding is lossless for any drafter, trained or random: each emitted token is the
target's argmax in its context. So the shipped EAGLE-3 drafters and a freshly built drafter of every other
family (random weights; PARD from the shipped toy draft LM) must all reproduce the target alone.

float32 runs every prompt in one batch and must be token-identical. bfloat16 runs each prompt alone (batch 1),
where the target alone and the verifying pass differ only in how many tokens one pass holds, and so in how
bf16 rounds: there an output passes if every place where it parts from the target alone is a near-tie, the
target's two logits within TIE_ULPS bf16 spacings of each other in one plain pass; from each such place the
target alone is run again from the engine's token, so every later token is checked too. A parting that is
not a near-tie fails, with the target's margin, so a wrong engine (margins of whole logits) cannot pass.

The engine takes no device argument: it builds its tensors with plain `torch.zeros`/`torch.arange`, so it
runs on the GPU under `with torch.device(dev)`, which is how this check runs it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from draftopd.config import DrafterConfig
from draftopd.drafters import load_drafter, new_drafter
from draftopd.engine.speculative import SpeculativeEngine
from draftopd.loading import ASSETS, eos_ids, load_target, load_tokenizer
from draftopd.messages import SamplingConfig

AUX = [1, 2, 3]  # the toy recipes' aux layers (the shipped EAGLE-3 drafters read these)
MASK = 5  # the toy tokenizer's <|mask|>
DFLASH_SHAPE = {"num_hidden_layers": 2, "block_size": 16, "mask_token_id": MASK}  # recipes/toy-dflash-sft.yaml
TIE_ULPS = 4  # a parting is a near-tie when the target's two logits are within this many bf16 spacings
ALLOW_TIES = {"float32": False, "bfloat16": True}  # float32 must be token-identical
MAX_PARTINGS = 16  # per prompt: more than this many near-ties is reported as a failure, not followed further


@dataclass
class DrafterCase:
    """One drafter to check: its name, K drafts per step, and how to build it for a target."""

    name: str
    k: int
    build: object  # target -> drafter (on the target's dtype, on the CPU)


def _shipped(name: str):
    return lambda target: load_drafter(ASSETS / name, target)


def _fresh(kind: str, **shape):
    def build(target):
        torch.manual_seed(0)
        return new_drafter(DrafterConfig(kind=kind, **shape), target, torch.arange(target.vocab_size))

    return build


def drafter_cases() -> list[DrafterCase]:
    """Every shipped drafter, and one of each other family built through the drafter interface."""
    return [
        DrafterCase("toy-eagle3", 4, _shipped("toy-eagle3")),
        DrafterCase("toy-eagle3-driftfix", 4, _shipped("toy-eagle3-driftfix")),
        DrafterCase("toy-eagle3-plateau", 4, _shipped("toy-eagle3-plateau")),
        DrafterCase("dflash (random)", 15, _fresh("dflash", **DFLASH_SHAPE)),
        DrafterCase("d2sd (random)", 15, _fresh("d2sd", **DFLASH_SHAPE)),
        DrafterCase("pard (toy draft LM)", 8, _fresh("pard", base_lm="toy", mask_token_id=MASK)),
    ]


def toy_prompts(n: int, arithmetic_only: bool = False) -> list[list[int]]:
    """Held-out prompts of the toy corpus as token ids; `arithmetic_only` skips building the corpus (whose code
    samples take tens of seconds on a busy CPU) and draws arithmetic questions alone."""
    import random

    from draftopd.data.prompts import encode_chats, load_prompts
    from draftopd.toy.corpus import arithmetic_sample, prompt_only

    if arithmetic_only:
        rng = random.Random(0)
        chats = [prompt_only(arithmetic_sample(rng)) for _ in range(n)]
    else:
        chats = load_prompts("toy", "held_out", n, 0)
    return encode_chats(load_tokenizer("toy"), chats, True)


def _decode(target, drafter, prompts, k: int, max_new: int, eos, device, batch: int):
    """Output ids per prompt and the steps' mean tokens per verification (tau; 0 without a drafter)."""
    outputs, steps = [], []
    with torch.device(device):  # the engine makes its tensors where the default device is
        engine = SpeculativeEngine(target, drafter, eos)
        for i in range(0, len(prompts), batch):
            for t in engine.generate(prompts[i : i + batch], SamplingConfig(max_new, 0.0, k, 0)):
                outputs.append(t.output_ids)
                steps += [s.num_accepted + 1 for s in t.steps]
    return outputs, (sum(steps) / len(steps) if steps else 0.0)


def _logits(target, prompt, common, want: int, got: int, device) -> tuple[float, float]:
    """The target's logits of `want` and `got` right after `prompt + common`, in one plain pass."""
    ids = torch.tensor([prompt + common], device=device)
    with torch.no_grad():
        logits = target.forward(ids, torch.arange(ids.shape[1], device=device)[None], want_aux=False).logits[0, -1]
    return float(logits[want].float()), float(logits[got].float())


def _margin(target, prompt, common, want: int, got: int, device) -> float:
    """The target's logit of `want` minus that of `got` right after `prompt + common`, in one plain pass."""
    a, b = _logits(target, prompt, common, want, got, device)
    return a - b


def bf16_spacing(x: float) -> float:
    """The distance between adjacent bfloat16 values at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-126))) - 7)


def _first_difference(a: list, b: list) -> int:
    """The first position where `a` and `b` differ; the shorter one's length where one is a prefix of the other."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _follow(target, prompt, ref, spec, eos, device, max_new: int) -> dict:
    """Walk `spec` against the target alone from `prompt` (`ref`: its output there at batch 1, or None to decode
    it): wherever they part, the parting must be a near-tie; the target alone then goes on from the engine's token.
    {"partings": [...], "lossless": bool}."""
    partings, anchor, alone = [], 0, ref
    while anchor < len(spec) and len(partings) <= MAX_PARTINGS:
        if anchor or alone is None:
            (alone,), _ = _decode(target, None, [prompt + spec[:anchor]], 0, max_new - anchor, eos, device, 1)
        rest = spec[anchor:]
        if alone == rest:
            return {"partings": partings, "lossless": True}
        j = _first_difference(alone, rest)
        if j == min(len(alone), len(rest)):  # one is a prefix of the other: a length difference is never a tie
            partings.append({"position": anchor + j, "length_difference": True})
            return {"partings": partings, "lossless": False}
        want, got = _logits(target, prompt, spec[: anchor + j], alone[j], rest[j], device)
        tol = TIE_ULPS * bf16_spacing(max(abs(want), abs(got)))
        tie = abs(want - got) <= tol
        partings.append({"position": anchor + j, "target_token": alone[j], "spec_token": rest[j],
                         "target_margin": want - got, "tolerance": tol, "near_tie": tie})  # fmt: skip
        if not tie:
            return {"partings": partings, "lossless": False}
        anchor += j + 1
    return {"partings": partings, "lossless": anchor >= len(spec)}


def _first_mismatch(target, prompts, ref, spec, device) -> dict | None:
    for i, (p, a, b) in enumerate(zip(prompts, ref, spec)):
        if a == b:
            continue
        j = _first_difference(a, b)
        if j == min(len(a), len(b)):  # one is a prefix of the other: a length difference
            return {"prompt": i, "position": j, "target_len": len(a), "spec_len": len(b)}
        margin = _margin(target, p, a[:j], a[j], b[j], device)
        return {"prompt": i, "position": j, "target_token": a[j], "spec_token": b[j], "target_margin": margin}
    return None


def check_dtype(dtype: str, prompts, max_new: int, device, batch: int, cases=None) -> list[dict]:
    """One record per drafter: identical or not, tokens compared, tau, first mismatch, seconds."""
    target = load_target("toy", AUX, dtype)
    target.model.to(device)
    eos = eos_ids(load_tokenizer("toy"), "toy")
    t0 = time.perf_counter()
    ref, _ = _decode(target, None, prompts, 0, max_new, eos, device, batch)
    records = [{"drafter": "(target alone)", "dtype": dtype, "batch": batch, "seconds": time.perf_counter() - t0}]
    for case in cases or drafter_cases():
        t0 = time.perf_counter()
        rec = {"drafter": case.name, "dtype": dtype, "batch": batch, "k": case.k}
        try:
            drafter = case.build(target).to(device)
            spec, tau = _decode(target, drafter, prompts, case.k, max_new, eos, device, batch)
            mismatch = _first_mismatch(target, prompts, ref, spec, device)
            rec.update(identical=mismatch is None, tokens=sum(map(len, ref)), tau=tau, first_mismatch=mismatch)
            rec["passed"] = mismatch is None
            if mismatch is not None and ALLOW_TIES[dtype]:
                walks = {i: _follow(target, p, r if batch == 1 else None, s, eos, device, max_new)
                         for i, (p, r, s) in enumerate(zip(prompts, ref, spec)) if r != s}  # fmt: skip
                rec["partings"] = [dict(x, prompt=i) for i, w in walks.items() for x in w["partings"]]
                rec["passed"] = all(w["lossless"] for w in walks.values())
        except Exception as exc:  # one family's failure must not hide the others
            rec.update(identical=False, passed=False, error=f"{type(exc).__name__}: {exc}")
        rec["seconds"] = time.perf_counter() - t0
        records.append(rec)
    return records


def run(device: str, prompts: list[list[int]], max_new: int) -> dict:
    """float32 in one batch of every prompt (token-identical), bfloat16 at batch 1 (identical up to near-ties)."""
    checks = check_dtype("float32", prompts, max_new, device, len(prompts))
    checks += check_dtype("bfloat16", prompts, max_new, device, 1)
    drafted = [c for c in checks if c["drafter"] != "(target alone)"]
    return {"ok": all(c["passed"] for c in drafted), "tie_ulps": TIE_ULPS, "checks": checks}
