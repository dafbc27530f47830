"""Writing drafter weights held as numpy arrays (what learners hand out) as an EAGLE-3 checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def save_drafter(state: dict[str, np.ndarray], drafter_config: dict, path: Path) -> None:
    from draftopd.models.eagle3 import Eagle3Config, Eagle3Drafter

    cfg = Eagle3Config.from_hf(drafter_config)
    tensors = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()}
    embed = torch.zeros(cfg.vocab_size, cfg.hidden_size)  # never saved: served drafters share the target's
    drafter = Eagle3Drafter(cfg, embed, d2t=tensors["d2t"])
    drafter.load_state_dict(tensors, strict=False)
    drafter.to(tensors["fc.weight"].dtype).save(path)
