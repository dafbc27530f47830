"""Writing drafter weights held as numpy arrays (what learners hand out) as an EAGLE-3 checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def save_drafter(state: dict[str, np.ndarray], drafter_config: dict, path: Path) -> None:
    from draftopd.models.eagle3 import Eagle3Config, Eagle3Drafter

    cfg = Eagle3Config.from_hf(drafter_config)
    # Never saved: served drafters share the target's embedding, so a placeholder of the weights' dtype will do.
    embed = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=torch.from_numpy(state["fc.weight"][:0].copy()).dtype)
    Eagle3Drafter.from_state(drafter_config, state, embed).save(path)
