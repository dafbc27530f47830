"""Shared fixtures: tiny random models (float64, so exactness tests test the algorithm, not rounding)."""

from pathlib import Path

import pytest
import torch

from draftopd.drafters import FAMILIES

torch.set_num_threads(1)  # tiny models: thread hand-offs cost more than they save


@pytest.fixture(scope="session", params=list(FAMILIES))
def tiny_pair(request):
    """A tiny target and a briefly trained drafter of each family: the exactness tests run once per family."""
    from draftopd.testing import tiny_target, train_tiny_drafter

    target = tiny_target(vocab=16)
    return target, train_tiny_drafter(target, kind=request.param)


# Families the Draft-OPD tests cannot run for, with the reason; their parametrizations there are skipped.
NOT_IN_OPD = {
    "d2sd": "Draft-OPD does not replay D²SD steps yet: a winning row mixes both drafters' tokens",
}
OPD_TESTS = ("test_opd.py", "test_opd_streams.py", "test_opd_loop.py", "test_learner_gpu.py")


# The suite runs on two xdist workers (pyproject's addopts), a module whole on one worker, so that its module
# fixtures (vLLM engines, servers, runs) start once; the modules that use the session's Ray all go to the same
# worker, so that one Ray instance serves the whole session. Checked at collection: a module that uses Ray and
# is not named here is an error.
ON_RAY = {
    "test_fleet.py",
    "test_learner_gpu.py",
    "test_opd_loop.py",
    "test_opd_vllm.py",
    "test_sync_failures.py",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndRay(LoadScopeScheduling):
        """xdist's per-module scheduling, with the Ray modules as one unit (run first: it is the longest)."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "ray" if Path(module).name in ON_RAY else module

    return ModulesAndRay(config, log)


def pytest_collection_modifyitems(config, items):
    on_ray = {item.path.name for item in items if "ray_session" in item.fixturenames}
    if on_ray - ON_RAY:
        raise pytest.UsageError(f"tests/conftest.py: add {sorted(on_ray - ON_RAY)} to ON_RAY (they use Ray)")
    for item in items:
        kind = getattr(item, "callspec", None) and item.callspec.params.get("tiny_pair")
        if kind in NOT_IN_OPD and item.path.name in OPD_TESTS:
            item.add_marker(pytest.mark.skip(reason=NOT_IN_OPD[kind]))


def random_prompts(n: int, vocab: int, seed: int, max_len: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, vocab, (int(m),), generator=g).tolist() for m in torch.randint(1, max_len, (n,), generator=g)
    ]


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session, with a capped object store."""
    import ray

    ray.init(address="local", num_cpus=4, object_store_memory=256 * 2**20, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def sync_actors(ray_session, tiny_pair, tmp_path_factory):
    """A one-rank DraftLearner (set up, rendezvous on its own node) and two rollout workers on Ray, all holding the
    tiny pair's drafter: the two ends of a collective weight sync. Started once for the session's sync tests;
    each test kills worker 1 once (Ray restarts it), and each publishes before it compares weights."""
    from draftopd.drafters import save_drafter
    from draftopd.opd.learner import DraftLearner, LearnerSpec
    from draftopd.opd.rollout import RolloutWorker
    from draftopd.schema import DrafterConfig

    ray, tmp_path = ray_session, tmp_path_factory.mktemp("sync-actors")
    target, drafter = tiny_pair
    target.model.save_pretrained(tmp_path / "tiny")
    init = str(save_drafter(drafter, tmp_path / "drafter"))
    spec = LearnerSpec(str(tmp_path / "tiny"), target.aux_layer_ids, "float32", DrafterConfig(kind=drafter.kind), init)
    learner = ray.remote(DraftLearner).options(num_cpus=0.5).remote(spec, 0, 1, "127.0.0.1", 0)
    worker_cls = ray.remote(RolloutWorker).options(num_cpus=0.25, max_restarts=4, max_task_retries=1)
    args = (str(tmp_path / "tiny"), target.aux_layer_ids, "float32", [1], 1)
    workers = [worker_cls.remote(*args, i) for i in range(2)]
    master = ray.get(learner.free_port.remote())
    ray.get([learner.setup.remote(2, master), *[w.pid.remote() for w in workers]])
    yield learner, workers
    for actor in [learner, *workers]:
        ray.kill(actor)
