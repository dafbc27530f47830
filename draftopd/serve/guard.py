"""The guard before every swap: is a candidate drafter better than the serving one on recent held-out traffic?

Both drafters re-decode every held-out request's prompt greedily with the native engine (a shadow decode: the
target's own text, so both see the same tokens), up to the request's recorded output length. Per request,
tau = tokens emitted per verification step; the evidence is the paired per-request difference
(candidate - incumbent), whose one-sided lower confidence bound must be above zero, and the pooled tau ratio,
which must reach 1 + margin. Anything else refuses: too few requests, non-finite candidate weights, or any
error while judging (the reason says which). The guard never raises.

Why a shadow decode rather than the records: the held-out requests were drafted by whatever version served
them, so their records say nothing about the candidate; re-decoding both drafters on the same prompts makes
the comparison paired and independent of the serving engine.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from draftopd.engine.speculative import SpeculativeEngine
from draftopd.messages import SamplingConfig, Trajectory

MIN_REQUESTS = 8


@dataclass
class Verdict:
    """A guard's decision and its evidence. `taus_*` are per-request taus (paired, same order); `lower` is the
    one-sided lower bound at `confidence` of the mean paired difference; `reason` says why in one line."""

    promote: bool
    reason: str
    tau_candidate: float = float("nan")
    tau_incumbent: float = float("nan")
    ratio: float = float("nan")
    mean_diff: float = float("nan")
    lower: float = float("nan")
    n: int = 0
    margin: float = 0.0
    confidence: float = 0.0
    seconds: float = 0.0
    taus_candidate: list[float] = field(default_factory=list)
    taus_incumbent: list[float] = field(default_factory=list)

    def evidence(self) -> dict:
        """The verdict as JSON-able numbers (non-finite values as None)."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile at `p` (Cornish-Fisher expansion around the normal's; within 1% for df >= 4)."""
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def nonfinite_weights(drafter) -> list[str]:
    """Names of the drafter's tensors holding a NaN or an infinity."""
    return [k for k, v in drafter.state().items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def shadow_taus(
    drafter, target, eos: list[int], trajs: list[Trajectory], k: int, max_new_tokens: int = 256, batch_size: int = 16
):
    """Per-request tau of `drafter` re-decoding each trajectory's prompt greedily over its first L tokens,
    L = its recorded output length capped at `max_new_tokens`; NaN where no step was taken. Requests are
    batched by length (a batch decodes to its longest L; each request's tau counts only the steps that start
    within its own L)."""
    engine = SpeculativeEngine(target, drafter.eval(), eos)
    budget = [min(max(len(t.output_ids), 1), max_new_tokens) for t in trajs]
    order = sorted(range(len(trajs)), key=budget.__getitem__)
    taus = [float("nan")] * len(trajs)
    for s in range(0, len(order), batch_size):
        chunk = order[s : s + batch_size]
        cfg = SamplingConfig(max(budget[i] for i in chunk), 0.0, k, 0)
        for i, out in zip(chunk, engine.generate([trajs[i].prompt_ids for i in chunk], cfg)):
            end = len(out.prompt_ids) + budget[i]  # output_ids[0] is the prefill's: steps start at prompt + 1
            steps = [st for st in out.steps if st.position < end]
            if steps:
                taus[i] = sum(len(st.emitted) for st in steps) / len(steps)
    return taus


def judge(
    candidate,
    incumbent,
    target,
    eos: list[int],
    trajs: list[Trajectory],
    k: int,
    margin: float = 0.02,
    confidence: float = 0.95,
    max_new_tokens: int = 256,
) -> Verdict:
    """Promote `candidate` over `incumbent` only when held-out `trajs` say it is better by `margin` at
    `confidence`, each request re-decoded up to its recorded length or `max_new_tokens` (the guard's cost);
    never raises (an error is a refusal with its reason). A request's tau is its tokens emitted per step; the
    verdict's `tau_*` are the means over requests."""
    start = time.perf_counter()
    base = {"margin": margin, "confidence": confidence}
    try:
        bad = nonfinite_weights(candidate)
        if bad:
            return Verdict(False, f"non-finite weights in {len(bad)} tensors ({bad[0]}, ...)", **base)
        with torch.no_grad():
            cand = shadow_taus(candidate, target, eos, trajs, k, max_new_tokens)
            inc = shadow_taus(incumbent, target, eos, trajs, k, max_new_tokens)
        verdict = _decide(cand, inc, margin, confidence)
    except Exception as exc:  # a broken candidate must not take the learner (or the server) down
        verdict = Verdict(False, f"error while judging: {type(exc).__name__}: {exc}")
    verdict.margin, verdict.confidence = margin, confidence
    verdict.seconds = time.perf_counter() - start
    return verdict


def _decide(cand: list[float], inc: list[float], margin: float, confidence: float) -> Verdict:
    pairs = [(c, i) for c, i in zip(cand, inc) if math.isfinite(c) and math.isfinite(i)]
    n = len(pairs)
    if n < MIN_REQUESTS:
        return Verdict(False, f"too few held-out requests with a verification step ({n} < {MIN_REQUESTS})", n=n)
    tc, ti = [c for c, _ in pairs], [i for _, i in pairs]
    diffs = [c - i for c, i in pairs]
    mean = sum(diffs) / n
    sd = statistics.stdev(diffs)
    lower = mean - t_quantile(confidence, n - 1) * sd / math.sqrt(n)
    mc, mi = sum(tc) / n, sum(ti) / n
    ratio = mc / mi
    out = Verdict(False, "", mc, mi, ratio, mean, lower, n, taus_candidate=tc, taus_incumbent=ti)
    if ratio < 1 + margin:
        out.reason = f"tau ratio {ratio:.3f} below 1 + margin ({1 + margin:.3f})"
    elif not lower > 0:
        out.reason = f"paired difference's {confidence:.0%} lower bound {lower:.3f} not above 0 (n={n})"
    else:
        out.promote = True
        out.reason = f"tau {mc:.3f} over {mi:.3f} (x{ratio:.3f}), lower bound {lower:.3f} > 0 (n={n})"
    return out
