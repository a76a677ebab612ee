"""trainer.max_staleness in the step loop (one gloo rank, the tiny demos): the version a sample carries is
the weights that generated it, the gap never exceeds K, and the prompt stream plus the batches generated ahead
survive preemption and crashes: every prompt trained once, none twice, none skipped (a per-step ledger of the
trained prompts against an uninterrupted run). The same on 2 and 4 ranks through torchrun:
tests/ppo/test_trainer.py (split) and tests/launcher/test_faults.py (kill -9, colocated)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.ppo.world import ROOT, tiny_run, world_of_one

STEPS = 6
SIGNAL = f"reward.function={ROOT}/tests/ppo/signal_rewards.py:digit_share"  # non-zero advantages untrained
COMMON = ["trainer.save_final=false", "trainer.save_every_minutes=0", "trainer.keep_last=1"]


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _digest(trainer) -> tuple[float, ...]:
    return tuple(float(p.detach().double().sum()) for _, p in trainer.roles.actor.runner.named_parameters())


def _trainer(run_dir, k: int, *overrides: str, config: str = "conf/grpo_tiny.yaml"):
    run_dir.mkdir(exist_ok=True)
    return tiny_run(run_dir, f"trainer.total_steps={STEPS}", f"trainer.max_staleness={k}", *COMMON, *overrides,
                    config=config).trainer(run_dir)


def _record_ledger(trainer, ledger: dict[int, list]) -> None:
    """ledger[step] = the prompts (ids and answer) of the batch the step trains; a re-run step overwrites."""
    draw = trainer.draw_batch

    def recorded(step, timer):
        out = draw(step, timer)
        ledger[step] = sorted((tuple(s.prompt_ids), s.ground_truth) for s in out[0].samples)
        return out

    trainer.draw_batch = recorded


@pytest.mark.parametrize("k", [1, 2])
def test_versions_are_the_generating_weights_and_the_gap_stays_within_k(world, tmp_path, k):
    t = _trainer(tmp_path, k, SIGNAL, config="conf/ppo_tiny.yaml")  # (a reward with signal: updates move the actor)
    weights, generated, rows = [], [], []
    generate = t.roles.rollout.generate

    def tagged(batch, *, step, seed, version, **kw):  # the weights the engine reads at each generation
        generated.append((step, version, _digest(t)))
        return generate(batch, step=step, seed=seed, version=version, **kw)

    t.roles.rollout.generate = tagged
    for step in range(STEPS):
        weights.append(_digest(t))  # version `step`: the actor after `step` updates
        rows.append(t.step(step))
    assert len(set(weights)) == STEPS  # every update moved the weights
    assert [s for s, _, _ in generated] == list(range(STEPS))  # each batch generated once, in order
    for step, version, digest in generated:
        assert digest == weights[version], (step, version)  # the tag names the weights that sampled
        assert step - k <= version <= step
    assert [r["async/staleness_max"] for r in rows] == [min(s, k) for s in range(STEPS)]
    assert all(r["async/staleness_mean"] == r["async/staleness_max"] for r in rows)  # a batch is one version
    assert [r["async/batches_ahead"] for r in rows] == [min(k, STEPS - 1 - s) for s in range(STEPS)]
    # tokens generated in each step (by its version): none once the run's last batch was generated
    assert [r["async/generated_tokens"] > 0 for r in rows] == [s + k < STEPS for s in range(STEPS)]


class _StopAfter:
    """stop_requested for PPOTrainer: 'SIGTERM' once the given step (1-based) has been trained."""

    def __init__(self, trainer, step: int):
        self.trainer, self.step, self.asks = trainer, step, 0

    def __call__(self):
        self.asks += 1
        return "SIGTERM" if self.asks >= self.step else None


def test_preemptions_and_a_crash_train_every_prompt_exactly_once(world, tmp_path):
    """K = 2: three SIGTERM preemptions in a row (after steps 1, 2 and 3, each resumed), then a crash in step 5
    after the periodic checkpoint of step 4 (the batches in flight at the save are trained after the restart,
    step 5 is re-run): the ledger and the final weights equal an uninterrupted run's."""
    straight, ledger = _trainer(tmp_path / "straight", 2), {}
    _record_ledger(straight, ledger)
    assert straight.fit() is None

    run, resumed = tmp_path / "stopped", {}
    for stop_after in (1, 1, 1):  # each launch trains one step and is preempted (saves, exits 75)
        t = _trainer(run, 2, "trainer.resume=auto")
        _record_ledger(t, resumed)
        t.stop_requested = _StopAfter(t, stop_after)
        assert t.fit() == "SIGTERM"
    assert len(t.ahead) == 2  # the checkpoint holds two batches generated ahead
    t = _trainer(run, 2, "trainer.resume=auto", "trainer.save_every=4")
    _record_ledger(t, resumed)
    step = t.step

    def crash_in_step_5(k):
        if k == 4:
            raise RuntimeError("killed")
        return step(k)

    t.step = crash_in_step_5
    with pytest.raises(RuntimeError, match="killed"):
        t.fit()
    t = _trainer(run, 2, "trainer.resume=auto")
    _record_ledger(t, resumed)
    assert t.fit() is None
    assert resumed == ledger and sorted(resumed) == list(range(STEPS))
    a, b = dict(straight.roles.actor.runner.named_parameters()), dict(t.roles.actor.runner.named_parameters())
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def test_a_rollout_correction_trains_stale_batches_by_decoupled_ppo(world, tmp_path):
    """K = 2 with algorithm.rollout_correction=tis: the ratio is taken against the trainer's current weights (the
    proximal policy; recomputed here, PPO's KL penalty needs it) and each token weighted by min(pi_prox / pi_behav,
    cap). Fresh batches (step 0) see engine and trainer agree; stale ones see the drift of 1 and 2 updates."""
    t = _trainer(tmp_path, 2, "algorithm.rollout_correction=tis", "actor.optim.lr=0.01", SIGNAL,
                 config="conf/ppo_tiny.yaml")
    assert t.old_logp_source() == "recompute"
    rows = [t.step(step) for step in range(4)]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2]
    assert rows[0]["rollout_corr/logprob_diff_max"] < 1e-4 and rows[0]["rollout/logprob_diff_max"] < 1e-4
    for r in rows[1:]:  # the proximal policy moved away from the behaviour policy; the ratio's KL sees it
        assert r["rollout/logprob_diff_max"] > 1e-3 and r["rollout_corr/k3_kl"] > 0
    # the same metrics split by the tokens' version gap (a batch ahead has one gap; partial rollouts mix them)
    for step, r in enumerate(rows):
        split = {k.split("/")[1] for k in r if k.startswith("rollout_corr/staleness_")}
        assert split == {f"staleness_{min(step, 2)}"}, (step, split)
        assert r[f"rollout_corr/staleness_{min(step, 2)}/logprob_diff_max"] == pytest.approx(
            r["rollout/logprob_diff_max"], abs=1e-6)


def _record_partial(trainer, spans: list) -> None:
    """spans += the versions each delivered trajectory's tokens came from (rollout.partial's groups)."""
    hybrid = trainer.roles.rollout.hybrid
    run = hybrid.generate_partial

    def recorded(*args, **kw):
        out = run(*args, **kw)
        spans.extend(sorted(set(t.versions)) for g in out.completions for t in g)
        return out

    hybrid.generate_partial = recorded


def test_over_provisioned_partial_rollouts_keep_the_bound_and_train_each_prompt_once(world, tmp_path):
    """rollout.batches_in_flight=2 at K=1 (responses up to 12 tokens, so groups finish at different steps): each
    step trains the first complete groups, the rest continue under the next weights; no trained token is more
    than one version old, every prompt drawn is trained once (the rest still in flight at the end), and a run
    preempted after step 2 and resumed trains the same prompts with the same final weights."""
    common = ["rollout.batches_in_flight=2", "rollout.max_response_length=12", "data.batch_size=4", SIGNAL]
    straight, ledger, spans = _trainer(tmp_path / "straight", 1, *common), {}, []
    _record_ledger(straight, ledger)
    _record_partial(straight, spans)
    drawn = []
    draw = straight.state.next_prompts
    straight.state.next_prompts = lambda step: [drawn.append((tuple(r["prompt_ids"]), r["ground_truth"])) or r
                                                for r in draw(step)]
    rows = []
    log = straight.state.log_metrics
    straight.state.log_metrics = lambda m: rows.append(m) or log(m)
    assert straight.fit() is None
    assert all(r["async/staleness_max"] <= 1 for r in rows) and max(r["async/staleness_max"] for r in rows) == 1
    assert [0, 1] in spans or [1, 2] in spans  # some responses were sampled by two versions
    assert straight.roles.rollout.partial.stats["recomputed_tokens"] > 0
    n = straight.settings.generation.n
    trained = [p for step in sorted(ledger) for p in ledger[step][::n]]  # one entry per group (sorted: n alike)
    assert len(drawn) == (STEPS + 1) * 4 and len(trained) == STEPS * 4
    left = list(drawn)
    for p in trained:  # each trained group consumes one drawn prompt: none twice, none that was not drawn
        left.remove(p)
    assert all(r["async/generated_tokens"] > 0 for r in rows)

    run, resumed = tmp_path / "stopped", {}
    t = _trainer(run, 1, *common, "trainer.resume=auto")
    _record_ledger(t, resumed)
    t.stop_requested = _StopAfter(t, 2)
    assert t.fit() == "SIGTERM" and t.roles.rollout.partial.in_flight()  # groups held, suspended:
    assert not t.roles.rollout.engine.has_unfinished()  # nothing decoding (the checkpoint holds them)
    t = _trainer(run, 1, *common, "trainer.resume=auto")
    _record_ledger(t, resumed)
    assert t.fit() is None
    assert resumed == ledger
    a, b = dict(straight.roles.actor.runner.named_parameters()), dict(t.roles.actor.runner.named_parameters())
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def _long_tail(trainer) -> None:
    """Every fourth prompt of a draw may answer 12 tokens, the others 2: the long groups outlast two steps."""
    draw = trainer.state.next_prompts
    trainer.state.next_prompts = lambda step: [dict(r, columns={"max_response_length": 12 if r["index"] % 4 == 0
                                                                else 2}) for r in draw(step)]


def _partial_run(tmp_path, policy: str, *overrides: str, stop_after: int | None = None):
    t = _trainer(tmp_path, 1, "rollout.batches_in_flight=2", "rollout.max_response_length=12", "data.batch_size=4",
                 f"trainer.stale_policy={policy}", SIGNAL, *overrides)
    _long_tail(t)
    ledger, rows = {}, []
    _record_ledger(t, ledger)
    log = t.state.log_metrics
    t.state.log_metrics = lambda m: rows.append(m) or log(m)
    if stop_after is not None:
        t.stop_requested = _StopAfter(t, stop_after)
    assert t.fit() == (None if stop_after is None else "SIGTERM")
    return t, ledger, rows


def test_dropping_stale_partial_rollouts_counts_them_and_records_each_prompt_once(world, tmp_path):
    """trainer.stale_policy=drop at K=1 with 2 batches in flight and a forced long tail: the long groups are not
    waited for (nothing paced) but dropped once they would be trained 2 versions old; the rows count them
    (async/dropped_groups, _samples), the prompt ledger records them, and every drawn prompt is trained once,
    dropped once, or still held at the end, never two of these. Fresh batches are drawn to refill what was
    dropped. The same run pacing (the default) waits for the long groups and drops nothing."""
    t, ledger, rows = _partial_run(tmp_path / "drop", "drop")
    n = t.settings.generation.n
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert all(r["async/paced_s"] == 0 for r in rows)
    dropped_groups = sum(r["async/dropped_groups"] for r in rows)
    assert dropped_groups > 0 and sum(r["async/dropped_samples"] for r in rows) == n * dropped_groups
    assert sum(r["async/dropped_tokens"] for r in rows) > 0
    entries = [json.loads(x) for x in (tmp_path / "drop" / "prompts.jsonl").read_text().splitlines()]
    drawn = [(e["epoch"], j) for e in entries if "rows" in e for j in e["rows"]]
    dropped = [tuple(s) for e in entries for s in e.get("dropped", [])]
    assert len(dropped) == dropped_groups and len(set(dropped)) == len(dropped)
    assert len(drawn) > (STEPS + 1) * 4  # refills: batches drawn beyond one a step
    key = {s: (tuple(t.state.dataset.row(s[1])["prompt_ids"]), t.state.dataset.row(s[1])["ground_truth"])
           for s in drawn}
    left = [key[s] for s in drawn]
    for s in dropped:
        left.remove(key[s])
    for p in (p for step in sorted(ledger) for p in ledger[step][::n]):  # one entry per trained group
        left.remove(p)
    # the rest: still in flight when the run ended
    assert len(left) == len(t.roles.rollout.partial.groups) == rows[-1]["async/groups_in_flight"]

    # preempted after step 3 (groups dropped before and after) and resumed: the same trained prompts, drops and
    # draws (the ledger's superseded rows aside) as the straight run
    run = tmp_path / "stopped"
    _, first, _ = _partial_run(run, "drop", "trainer.resume=auto", stop_after=3)
    _, second, _ = _partial_run(run, "drop", "trainer.resume=auto")
    assert {**first, **second} == ledger
    assert (run / "prompts.jsonl").read_text() == (tmp_path / "drop" / "prompts.jsonl").read_text()

    _, _, paced = _partial_run(tmp_path / "pace", "pace")
    assert all(r["async/dropped_groups"] == 0 and r["async/staleness_max"] <= 1 for r in paced)
    assert sum(r["async/paced_s"] for r in paced) > 0


def test_partial_rollouts_can_keep_their_kv_across_the_weight_swap(world, tmp_path):
    """rollout.partial_kv=keep (engine resident: rollout.free_memory_on_sleep=false): the samples suspended at the
    end of a step keep their KV parked in the engine and continue from it after the update (one token prefilled
    each, instead of their whole context); the bound still holds."""
    common = ["rollout.batches_in_flight=2", "rollout.max_response_length=12", "data.batch_size=4", SIGNAL,
              "rollout.partial_kv=keep", "rollout.free_memory_on_sleep=false", "trainer.total_steps=3"]
    t, rows = _trainer(tmp_path, 1, *common), []
    log = t.state.log_metrics
    t.state.log_metrics = lambda m: rows.append(m) or log(m)
    assert t.fit() is None
    partial, engine = t.roles.rollout.partial, t.roles.rollout.engine
    assert partial.stats["swaps"] == 3 and partial.stats["recomputed_tokens"] == 0
    # more samples in flight than slots: some wait (no KV to keep) and parked ones may be evicted; the rest resume
    assert engine.stats["kv_reused_tokens"] > 0
    assert all(r["async/staleness_max"] <= 1 for r in rows)


def test_groups_in_flight_decode_beside_the_update_and_keep_the_bound(world, tmp_path):
    """rollout.decode_beside (a forced long tail, K=1, two batches in flight; the CPU's auto keeps the engine
    resident for it): the groups left in flight after a step's generation decode on while the step trains, the rows
    count those tokens, the bound holds, every drawn prompt is trained at most once, and a preemption finds them
    suspended (nothing decoding into the checkpoint)."""
    beside = "rollout.decode_beside=true"
    t = _trainer(tmp_path / "straight", 1, "rollout.batches_in_flight=2", "rollout.max_response_length=12",
                 "data.batch_size=4", SIGNAL, beside)
    _long_tail(t)
    ledger, rows, drawn = {}, [], []
    _record_ledger(t, ledger)
    draw, log = t.state.next_prompts, t.state.log_metrics
    t.state.next_prompts = lambda step: [drawn.append((tuple(r["prompt_ids"]), r["ground_truth"])) or r
                                         for r in draw(step)]
    t.state.log_metrics = lambda m: rows.append(m) or log(m)
    assert t.fit() is None
    assert t.settings.generation.engine.free_memory_on_sleep is False
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert sum(r["async/beside_tokens"] for r in rows) > 0 and all("async/beside_s" in r for r in rows)
    for p in (p for step in sorted(ledger) for p in ledger[step][::t.settings.generation.n]):
        drawn.remove(p)  # each trained group consumes one drawn prompt: none twice, none that was not drawn
    assert t.roles.rollout.beside is None and not t.roles.rollout.engine.has_unfinished()

    t, _, rows = _partial_run(tmp_path / "stopped", "pace", beside, "trainer.resume=auto", stop_after=2)
    # groups held for the next step (suspended, or completed beside: how far they got depends on the update's time)
    assert t.roles.rollout.partial.groups and not t.roles.rollout.engine.has_unfinished()
    t, _, rows = _partial_run(tmp_path / "stopped", "pace", beside, "trainer.resume=auto")
    assert len(rows) == STEPS - 2 and all(r["async/staleness_max"] <= 1 for r in rows)
    # with kept KV: the samples still decoding at a step's end park (whether any does depends on how long the update
    # took; tests/rollout/test_partial.py proves the reuse itself) and the bound holds
    t, _, rows = _partial_run(tmp_path / "keep", "pace", beside, "rollout.partial_kv=keep",
                              "rollout.free_memory_on_sleep=false")
    assert len(rows) == STEPS and all(r["async/staleness_max"] <= 1 for r in rows)
