"""The drafter a serving bench starts from when it is named by family (`--drafter eagle3|dflash|pard`) on the toy
target: the family's SFT drafter on the target's own text, what a user would ship before serving.

EAGLE-3's is shipped (`toy`, recipes/toy-sft.yaml). DFlash's and PARD's are trained here once by the toy recipes
(`draftopd train`, in a subprocess: its own threads and memory) and kept under the bench's output directory, so a
second bench on the same directory reuses them: DFlash at blocks of 8 (7 drafts per step, the B=8 arm of
docs/experiments.md), PARD-2 as its recipe ships (8 drafts per pass, served target-independent by vLLM).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# family: (recipe, its overrides, K served, exported for vLLM); None: the shipped drafter
FAMILY_SFT = {
    "eagle3": (None, [], 4, False),
    "dflash": (
        "toy-dflash-sft.yaml",
        ["drafter.block_size=8", "sft.ttt_depth=7", "sft.depth_decay=0.7788", "eval.num_draft_tokens=[7]"],
        7,
        False,  # z-lab's layout is vLLM's
    ),
    "pard": ("toy-pard2-sft.yaml", [], 8, True),  # vLLM serves (and the fleet then trains) the TI mode
}


def family_k(name: str, default: int = 4) -> int:
    """K served for a family name (`init:FAMILY` too, day 0); `default` for anything else."""
    found = FAMILY_SFT.get(name.removeprefix("init:"))
    return found[2] if found else default


def recipes_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "recipes"


def family_drafter(name: str, target: str, out: Path) -> tuple[str, int]:
    """(drafter directory or shipped name, K) for family `name`, training its SFT drafter into
    `out/drafters/NAME-sft` when it is not there yet."""
    recipe, overrides, k, export = FAMILY_SFT[name]
    if recipe is None:
        return "toy", k
    if target != "toy":
        raise SystemExit(f"--drafter {name}: family names train on the toy target only; pass a drafter directory")
    path = recipes_dir() / recipe
    if not path.is_file():
        raise SystemExit(f"--drafter {name}: {path} not found (a source checkout has it); pass a drafter directory")
    run = out / "drafters" / f"{name}-sft"
    done = run / "checkpoints" / "final"
    if not (done / "config.json").is_file():
        print(f"training the {name} SFT drafter ({recipe}) into {run}", flush=True)
        cmd = [sys.executable, "-m", "draftopd.cli", "train", str(path), *overrides]
        cmd += [f"run.out_dir={run.parent}", f"run.name={run.name}"]
        subprocess.run(cmd, check=True)
        if not (done / "config.json").is_file():
            raise SystemExit(f"--drafter {name}: training finished without {done}")
    if not export:
        return str(done), k
    served = run / "vllm"
    if not (served / "config.json").is_file():
        cmd = [sys.executable, "-m", "draftopd.cli", "export", "--drafter", str(done), "--format", "vllm"]
        subprocess.run([*cmd, "--out", str(served), "--num-draft-tokens", str(k)], check=True)
    return str(served), k
