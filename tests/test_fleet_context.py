"""The fleet learner's context window: what a cut trajectory keeps, and each family's window."""

from draftopd.drafters import family
from draftopd.messages import Trajectory
from draftopd.serve.fleet_learner import clip_context
from draftopd.serve.settings import ServeSettings
from draftopd.vllm_backend.steps import stock_steps


def _traj(prompt: int, response: int) -> Trajectory:
    t = Trajectory(
        prompt_ids=list(range(100, 100 + prompt)),
        output_ids=list(range(900, 900 + response)),
        num_draft_tokens=4,
        policy_version=0,
    )
    accepted = [2, 0, 3, 1] + [0] * (response - 1 - 9)
    t.steps = stock_steps(t, {"per_step_accepted": accepted, "per_step_drafted": [4] * len(accepted)})
    return t


def test_a_cut_prompt_keeps_its_last_tokens_and_every_step_still_points_at_its_own_tokens():
    t = _traj(300, 20)
    cut = clip_context(t, 256)
    assert cut.prompt_ids == t.prompt_ids[-256:] and cut.output_ids == t.output_ids
    assert len(cut.steps) == len(t.steps)
    for before, after in zip(t.steps, cut.steps):
        assert before.position - after.position == 44
        span = slice(after.position - 1, after.position + len(after.emitted))
        assert cut.full_ids[span] == t.full_ids[before.position - 1 : before.position + len(before.emitted)]
    assert clip_context(t, 300) is t and clip_context(_traj(10, 20), 256).prompt_ids == list(range(100, 110))


def test_pard_learns_from_whole_prompts_at_the_serving_length_and_the_drafters_that_read_the_target_from_a_window():
    served = ServeSettings().max_model_len
    assert family("pard").learner_context >= served
    for kind in ("eagle3", "dflash"):
        assert family(kind).learner_context < served
