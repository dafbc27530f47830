"""A SLURM batch script for a recipe: Ray head and workers started with srun, then the driver.

The script is `slurm.sbatch` beside this module with its @NAME@ fields filled in. Each job makes a Ray token of its
own, which srun hands to every Ray process; it never appears in the rendered script.
"""

from __future__ import annotations

import shlex
from importlib.resources import files

from draftopd.cluster.layout import RAY_PORT, Layout


def render_sbatch(layout: Layout, command: str, script: str, overrides: list[str] | None = None) -> str:
    """The batch script of one recipe; `script` is its path as the usage line in it names it."""
    g = layout.gpus_per_node
    # A layout with GPUs takes whole nodes: Ray's ports and the GPUs are not shared with other jobs.
    gpu_lines = f"#SBATCH --gpus-per-node={g}\n#SBATCH --exclusive\n" if g else ""
    values = {
        "COMMAND": command,
        "RECIPE": layout.recipe,
        "DESCRIBE": layout.describe(),
        "SCRIPT": script,
        "NAME": layout.name,
        "NODES": str(layout.num_nodes),
        "CPUS": str(layout.cpus_per_node),
        "GPUS": str(g),
        "MEMORY": str(layout.memory_gb_per_node),
        "GPU_LINES": gpu_lines,
        "GPU_SRUN": ' --gpus-per-node="$GPUS"' if g else "",
        "RAY_PORT": str(RAY_PORT),
        "OVERRIDES": "".join(f" {shlex.quote(o)}" for o in overrides or []),
    }
    text = files("draftopd.cluster").joinpath("slurm.sbatch").read_text(encoding="utf-8")
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text
