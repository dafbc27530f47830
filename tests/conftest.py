"""Shared fixtures: tiny random models (float64, so exactness tests test the algorithm, not rounding)."""

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


def pytest_collection_modifyitems(config, items):
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
