"""`python -m launcher.config [section]`: every key with type, default and meaning from the schema; list
overrides; the checks of the validation / samples / epochs keys."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config.doc import describe, main, undocumented_keys
from launcher.config.load import load_config
from launcher.errors import UserError

ROOT = Path(__file__).resolve().parents[3]


def test_every_key_has_a_meaning():
    # a field added to launcher/config/schema.py without a comment beside (or above) it fails here
    assert undocumented_keys() == []
    docs = {d.key: d for d in describe()}
    assert (docs["data.val_files"].type, docs["data.val_files"].default) == ("list[str]", "[]")
    assert (docs["data.answer_key"].type, docs["data.answer_key"].default) == ("str | None", "null")
    assert docs["trainer.test_freq"].meaning.startswith("validate on data.val_files every N steps")
    assert "inherited" not in docs["actor.tp"].meaning and docs["critic.tp"].meaning == "tensor-parallel degree"
    assert docs["placement.pools[].size"].type == "int"
    # a section's own defaults, not its class's: the critic's learning rate is 10x the actor's
    assert (docs["actor.optim.lr"].default, docs["critic.optim.lr"].default) == ("1e-06", "1e-05")
    # choices are appended when the comment does not list them all
    assert "(one of: auto | hybridrl | verl)" not in docs["reward.signature"].meaning  # the comment names them
    assert "(one of" not in docs["model.dtype"].meaning
    assert docs["rollout.decode_attention"].meaning.endswith(
        "(one of: auto | triton | sdpa | sdpa-efficient | sdpa-cudnn | bmm)")
    assert "(one of: ppo | grpo | rloo | reinforce_pp)" not in docs["algorithm.name"].meaning
    assert "(one of: 1F1B | interleaved)" not in docs["ref.pp_schedule"].meaning


def test_cli_section_and_errors(capsys):
    assert main(["rollout"]) == 0
    out = capsys.readouterr().out
    assert "rollout.val_temperature" in out and "validation sampling temperature (0: greedy)" in out
    assert "trainer." not in out
    assert main(["actor.optim"]) == 0
    out = capsys.readouterr().out
    assert "actor.optim.betas" in out and "actor.ppo_epochs" not in out
    assert main(["data", "rolout"]) == 2
    assert "no config keys under 'rolout'; sections: actor, agent, algorithm" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "launcher.config", "data"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "data.train_files" in proc.stdout
    proc = subprocess.run([sys.executable, "launcher/main.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "python -m launcher.config [section]" in proc.stdout


def test_list_overrides(tmp_path):
    assert load_config(None, ["data.train_files=/a.jsonl"]).data.train_files == ["/a.jsonl"]
    assert load_config(None, ["data.val_files=[a.parquet,b.parquet]"]).data.val_files == ["a.parquet", "b.parquet"]
    (tmp_path / "c.yaml").write_text("data:\n  train_files: train.parquet\n")
    assert load_config(tmp_path / "c.yaml").data.train_files == ["train.parquet"]
    # before: "AnyNode is not a ListConfig"
    with pytest.raises(UserError, match=r"command line: 'actor.optim.betas' is a list; write "
                                        r"actor.optim.betas=\[0.9,0.95\] \(got 0.9\)"):
        load_config(None, ["actor.optim.betas=0.9"])


@pytest.mark.parametrize("overrides,needle", [
    (["trainer.test_freq=5"], "trainer.test_freq=5 acts only with data.val_files, which is not set; set "
                              "data.val_files=[val.parquet] or remove trainer.test_freq"),
    (["rollout.val_n=4", "rollout.val_temperature=1"], "rollout.val_n=4 acts only with data.val_files"),
    (["trainer.log_samples_count=8"], "trainer.log_samples_count=8 acts only with trainer.log_samples_every, "
                                      "which is not set; set trainer.log_samples_every=10"),
    (["data.val_files=v.jsonl", "rollout.val_n=4"], "draws 4 identical samples; set rollout.val_temperature=1.0"),
    (["data.sft_answer_key=extra_info.answer"], "data.sft_answer_key='extra_info.answer' is read by the SFT warm-up"),
    (["trainer.total_epochs=-1"], "trainer.total_epochs(-1) must be >= 0"),
    (["trainer.log_samples_count=0"], "trainer.log_samples_count(0) must be >= 1"),
    (["reward.signature=verll"], "reward.signature='verll' is not one of auto, hybridrl, verl"),
])
def test_new_keys_are_checked(overrides, needle):
    with pytest.raises(UserError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


def test_recipe_configs_name_what_is_missing(tmp_path):
    """conf/grpo_gsm8k_qwen3.yaml needs a model, data and validation data: each missing one is named."""
    given = []
    for override, needle in ((f"model.path={tmp_path}", "model.path is required"),
                             ("data.train_files=train.parquet", "data.train_files is required"),
                             ("data.val_files=test.parquet", "trainer.test_freq=10 acts only with data.val_files")):
        with pytest.raises(UserError, match=needle):
            load_config(ROOT / "conf" / "grpo_gsm8k_qwen3.yaml", given)
        given.append(override)
    cfg = load_config(ROOT / "conf" / "grpo_gsm8k_qwen3.yaml", given)
    assert (cfg.model.tokenizer, cfg.reward.signature, cfg.algorithm.name) == ("auto", "auto", "grpo")
    tiny = load_config(ROOT / "conf" / "grpo_verl_tiny.yaml", given[1:])
    assert (tiny.model.path, tiny.model.preset, tiny.trainer.device, tiny.rollout.val_n) == (None, "tiny-qwen3",
                                                                                             "cpu", 2)
