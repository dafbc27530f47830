"""Run inside the speculators library's own environment (see tests/test_interop.py): no draftopd import here.

argv: a job JSON. `convert`: speculators' converter from an EAGLE-layout checkpoint.
`logits`: each drafter directory loaded as the library's Eagle3 model, its TTT
logits per step on the given inputs saved as [steps, n, Vd] under the same name.
"""

import json
import sys

import torch


def logits(job: dict) -> None:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    inputs = torch.load(job["inputs"], weights_only=True)
    hidden, ids = inputs["aux"], inputs["ids"]
    n = hidden.shape[1]
    out = {}
    for name, path in job["drafters"].items():
        cfg = Eagle3SpeculatorConfig.from_pretrained(path)
        cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention wants a GPU
        model = Eagle3DraftModel.from_pretrained(path, config=cfg).eval()
        steps: list[torch.Tensor] = []
        model.lm_head.register_forward_hook(lambda m, i, o, steps=steps: steps.append(o[0].detach()))
        with torch.no_grad():
            model(
                hidden_states=hidden,
                input_ids=ids[:, 1 : n + 1],
                document_ids=torch.zeros(1, n, dtype=torch.long),
                position_ids=torch.arange(n)[None],
                ttt_steps=job["steps"],
            )
        out[name] = torch.stack(steps)
    torch.save(out, job["out"])


def convert(job: dict) -> None:
    from speculators.convert.entrypoints import convert_model

    convert_model(
        model=job["eagle"],
        verifier=job["verifier"],
        algorithm="eagle3",
        output_path=job["out"],
        **job.get("options", {}),
    )


if __name__ == "__main__":
    job = json.loads(open(sys.argv[1]).read())
    {"logits": logits, "convert": convert}[job["mode"]](job)
