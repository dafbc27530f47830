"""A learner rank that Ray gives a GPU computes there (NCCL group, model and batches on cuda:0).

Its losses must equal the CPU reference computed in this process from the same weights (float64 here,
float32 in the rank: DeepSpeed does not reduce float64 gradients).
"""

import pytest
import torch

from draftopd.ports import free_port


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_learner_rank_matches_the_cpu_losses(ray_session, tiny_pair, tmp_path):
    from draftopd.config import DrafterConfig
    from draftopd.drafters import save_drafter
    from draftopd.engine.speculative import SamplingConfig, SpeculativeEngine
    from draftopd.messages import ErrorState
    from draftopd.opd.learner import DraftLearner, LearnerSpec
    from draftopd.opd.replay import OPDLossConfig, build_replay_batch, opd_loss, target_to_draft_index
    from draftopd.sft.trainer import SFTExample, collate, ttt_loss

    target, drafter = tiny_pair
    target.model.save_pretrained(tmp_path / "tiny")
    init = str(save_drafter(drafter, tmp_path / "drafter"))
    spec = LearnerSpec(str(tmp_path / "tiny"), target.aux_layer_ids, "float32", DrafterConfig(), init, lr=1e-2)
    learner = ray_session.remote(DraftLearner).options(num_cpus=0.25, num_gpus=1).remote(spec, 0, 1, "127.0.0.1", 0)
    ray_session.get(learner.setup.remote(4, ("127.0.0.1", free_port())))

    examples = [SFTExample([3, 4, 5, 6, 7, 8, 9, 10, 11], 3), SFTExample([5, 6, 7, 8], 2)]
    with torch.no_grad():
        want_sft, _ = ttt_loss(drafter, target, collate(examples, 64), 3, 0.8)
    got = ray_session.get(learner.sft_step.remote(examples, 3, 0.8, 64, 0.0))  # lr 0: the weights stay
    assert got["skipped_nonfinite"] == 0 and got["loss"] == pytest.approx(want_sft.item(), rel=1e-4)

    trajs = SpeculativeEngine(target, drafter, [1]).generate([[3, 4, 5], [6, 7]], SamplingConfig(30, 0.0, 4), 0)
    states = [ErrorState(t, i, 0) for t in trajs for i, s in enumerate(t.steps) if s.rejected]
    assert states
    t2d = target_to_draft_index(drafter.draft_to_target_ids(), target.vocab_size)
    with torch.no_grad():
        want_opd, _ = opd_loss(drafter, target, build_replay_batch(states, t2d, 4, 0.8, 128), OPDLossConfig())
    got = ray_session.get(learner.opd_step.remote(states, 4, 0.8, 128, OPDLossConfig(), 0.0))
    assert got["loss"] == pytest.approx(want_opd.item(), rel=1e-4)

    before = ray_session.get(learner.weights.remote())
    got = ray_session.get(learner.opd_step.remote(states, 4, 0.8, 128, OPDLossConfig(), 1e-2))
    after = ray_session.get(learner.weights.remote())
    assert got["skipped_nonfinite"] == 0 and not torch.equal(before["fc.weight"], after["fc.weight"])
    ray_session.kill(learner)
