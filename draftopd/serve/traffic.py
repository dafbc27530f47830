"""TrafficBuffer: the served requests' verification records, which the serving learner trains on.

Every finished request of `draftopd serve` arrives here as a `Trajectory` (token ids and verification steps,
no text). Every `holdout_every`-th one goes to a held-out slice that the learner never trains on: the guard
judges candidates on it, so a candidate is never scored on requests it learned from. Memory is bounded:
`capacity` trajectories in both slices together, the oldest dropped first, and with `retention_s` nothing older
than that is kept (in memory or on disk). One lock guards everything: the server's recording task adds, the
learner's thread reads.

This is serving's store, not the learner's sampler: the learner takes the training slice's new trajectories
(`train_since`) into opd's replay buffer and samples there, and withdraws from it what this store no longer
holds (`training`), so the retention and the capacity bound what it trains on too.

On disk (`save`/`load`, so a restarted server resumes its buffer) each trajectory is one JSON line: its
`Trajectory.to_dict()` with the slice, the time it was recorded, its traffic domain and, only with
`keep_text`, its text.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from draftopd.messages import Trajectory

FILE = "traffic.jsonl"
META = "traffic.json"


@dataclass
class Record:
    """One served request: the trajectory, the wall-clock time it was recorded, its place in the order of arrival
    (`seq`, counting every trajectory the buffer ever took), its domain, and its text only when the buffer keeps
    text."""

    trajectory: Trajectory
    added_at: float
    seq: int
    domain: str = ""
    text: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.trajectory.output_ids)


class TrafficBuffer:
    """Recent served trajectories: a training slice and a held-out slice, bounded together, thread-safe."""

    def __init__(
        self,
        capacity: int,
        holdout_every: int = 5,
        keep_text: bool = False,
        retention_s: float = 0.0,
    ):
        if capacity < 2 or holdout_every < 2:
            raise ValueError(f"capacity ({capacity}) and holdout_every ({holdout_every}) must be at least 2")
        self.capacity, self.holdout_every, self.keep_text = capacity, holdout_every, keep_text
        self.retention_s = retention_s  # 0: keep until dropped for room
        self._train: deque[Record] = deque()
        self._held: deque[Record] = deque()
        self._lock = threading.Lock()
        self.num_added = self.num_dropped = self.num_expired = 0
        self.tokens_recorded = 0  # output tokens ever added: the learner's budget counts from it

    # -- writing ------------------------------------------------------------------------------------

    def add(self, trajs: list[Trajectory], domains: list[str] | None = None, texts: list[str] | None = None) -> None:
        """Record finished requests: every `holdout_every`-th to the held-out slice, the rest to training;
        `texts` are kept only with `keep_text`."""
        now = time.time()
        with self._lock:
            for i, t in enumerate(trajs):
                text = texts[i] if texts is not None and self.keep_text else None
                rec = Record(t, now, self.num_added, domains[i] if domains else "", text)
                held = self.num_added % self.holdout_every == self.holdout_every - 1
                (self._held if held else self._train).append(rec)
                self.num_added += 1
                self.tokens_recorded += rec.num_tokens
            self._expire(now)
            while len(self._train) + len(self._held) > self.capacity:
                self._oldest_queue().popleft()
                self.num_dropped += 1

    def _oldest_queue(self) -> deque:
        if not self._held:
            return self._train
        if not self._train:
            return self._held
        return self._train if self._train[0].seq < self._held[0].seq else self._held

    def _expire(self, now: float) -> None:
        """Drop what is older than the retention (both slices); called under the lock."""
        if self.retention_s <= 0:
            return
        for q in (self._train, self._held):
            while q and now - q[0].added_at > self.retention_s:
                q.popleft()
                self.num_expired += 1

    # -- reading ------------------------------------------------------------------------------------

    def training(self) -> list[Trajectory]:
        """Every trajectory of the training slice held now (oldest first), those without a verification step too."""
        with self._lock:
            self._expire(time.time())
            return [r.trajectory for r in self._train]

    def train_since(self, seq: int) -> tuple[list[Trajectory], int]:
        """(the training slice's trajectories recorded at or after arrival number `seq` and still held, oldest
        first; the `seq` to ask with next time)."""
        with self._lock:
            self._expire(time.time())
            return [r.trajectory for r in self._train if r.seq >= seq], self.num_added

    def num_gone(self) -> int:
        """Trajectories that left the buffer (dropped for room or expired) since it began: a reader holding copies
        of its contents re-checks them when this changes."""
        with self._lock:
            self._expire(time.time())
            return self.num_dropped + self.num_expired

    def holdout(self, n: int) -> list[Trajectory]:
        """The newest `n` held-out trajectories (oldest first): the guard's evidence, never trained on."""
        with self._lock:
            self._expire(time.time())
            return [r.trajectory for r in list(self._held)[-n:]] if n > 0 else []

    def num_trainable(self) -> int:
        with self._lock:
            return sum(1 for r in self._train if r.trajectory.steps)

    def new_tokens_since(self, mark: int) -> int:
        """Output tokens recorded since `mark` (a past value of `tokens_recorded`)."""
        with self._lock:
            return self.tokens_recorded - mark

    def records(self) -> list[tuple[str, Record]]:
        """Every record held with its slice ("train" or "holdout"), in order of arrival: what a reader of a saved
        buffer (`draftopd rejections`) sees, domains included."""
        with self._lock:
            self._expire(time.time())
            held = [("train", r) for r in self._train] + [("holdout", r) for r in self._held]
        return sorted(held, key=lambda x: x[1].seq)

    def stats(self) -> dict:
        with self._lock:
            records = list(self._train) + list(self._held)
            return {
                "trajectories": len(records),
                "train": len(self._train),
                "holdout": len(self._held),
                "tokens": sum(r.num_tokens for r in records),
                "capacity": self.capacity,
                "added": self.num_added,
                "dropped": self.num_dropped,
                "expired": self.num_expired,
                "tokens_recorded": self.tokens_recorded,
                "domains": _count(r.domain for r in records if r.domain),
            }

    # -- persistence ----------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write the buffer to `directory` (replaced atomically): token ids, never text unless `keep_text`."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._expire(time.time())
            lines = [_line(r, "train") for r in self._train] + [_line(r, "holdout") for r in self._held]
            meta = {k: getattr(self, k) for k in ("num_added", "num_dropped", "num_expired", "tokens_recorded")}
        tmp = out / (FILE + ".tmp")
        tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
        tmp.replace(out / FILE)
        (out / META).write_text(json.dumps(meta) + "\n")
        return out / FILE

    @classmethod
    def load(cls, directory: str | Path, capacity: int, **kwargs) -> TrafficBuffer:
        """A buffer with what `save` wrote in `directory` (empty when nothing was), under today's settings:
        what is past the retention is dropped, text is dropped unless `keep_text`, and the newest `capacity`
        trajectories are kept."""
        buf = cls(capacity, **kwargs)
        path, meta = Path(directory) / FILE, Path(directory) / META
        if not path.is_file():
            return buf
        records = []
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                rec = Record(Trajectory.from_dict(d["trajectory"]), d["added_at"], d["seq"], d.get("domain", ""))
                rec.text = d.get("text") if buf.keep_text else None
                records.append((d["split"], rec))
        records.sort(key=lambda x: x[1].seq)
        for split, rec in records[-capacity:]:
            (buf._held if split == "holdout" else buf._train).append(rec)
        if meta.is_file():
            for k, v in json.loads(meta.read_text()).items():
                setattr(buf, k, v)
        buf.num_dropped += max(len(records) - capacity, 0)
        buf._expire(time.time())
        return buf


def _line(rec: Record, split: str) -> dict:
    out = {"split": split, "seq": rec.seq, "added_at": rec.added_at, "domain": rec.domain}
    out["trajectory"] = rec.trajectory.to_dict()
    if rec.text is not None:
        out["text"] = rec.text
    return out


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out
