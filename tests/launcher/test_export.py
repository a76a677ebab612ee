"""launcher.export: checkpoint role -> Hugging Face directory, with validation and exit codes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.export import ExportError, export_checkpoint, main
from models import build_model
from models.heads import LlamaForValue
from ppo.run.checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _checkpoint(run_dir: Path, step: int = 4, *, critic=True):
    actor = build_model("tiny", seed=1)
    states = {"actor": actor.state_dict()}
    configs = {"actor": actor.config.to_hf()}
    if critic:
        torch.manual_seed(2)
        value = LlamaForValue(actor.config)
        torch.nn.init.normal_(value.score.weight, std=0.1)
        states["critic"] = value.state_dict()
        configs["critic"] = actor.config.to_hf(architecture="ForSequenceClassification")
    path = save_checkpoint(run_dir, step, rank=0, world_size=1, per_rank_state={}, model_states=states,
                           model_configs=configs)
    return path, actor, states


def test_export_actor_loads_in_transformers_and_matches(tmp_path):
    transformers = pytest.importorskip("transformers")
    ckpt, actor, _ = _checkpoint(tmp_path / "run")
    out = export_checkpoint(tmp_path / "run", tmp_path / "hf_actor")  # run dir -> newest checkpoint
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors"}
    assert (out / "model.safetensors").read_bytes() == (ckpt / "actor" / "model.safetensors").read_bytes()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 512, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, actor(ids), rtol=1e-4, atol=1e-4)


def test_export_critic_with_dtype(tmp_path):
    ckpt, _, states = _checkpoint(tmp_path / "run")
    tok = tmp_path / "base"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    (tok / "README.md").write_text("not copied")
    out = export_checkpoint(ckpt, tmp_path / "hf_critic", role="critic", dtype=torch.bfloat16, tokenizer_dir=tok)
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer_config.json"}
    from models.hf_io import load_tensors

    got = load_tensors(out)
    assert got.keys() == states["critic"].keys()
    assert got["score.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(got["score.weight"].float(), states["critic"]["score.weight"].bfloat16().float())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["dtype"] == "bfloat16"


def test_export_errors(tmp_path, capsys):
    ckpt, _, _ = _checkpoint(tmp_path / "run", critic=False)
    with pytest.raises(ExportError, match=r"no 'critic' weights; roles saved: \['actor'\]"):
        export_checkpoint(ckpt, tmp_path / "o1", role="critic")
    shards_only = save_checkpoint(tmp_path / "run", 6, rank=0, world_size=1, per_rank_state={})
    with pytest.raises(ExportError, match=r"roles saved: none; checkpoints of this run with 'actor' weights: "
                                          r"\['step_4'\]"):
        export_checkpoint(shards_only, tmp_path / "o1")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(ckpt, tmp_path / "busy")
    with pytest.raises(ExportError, match="no tokenizer files"):
        export_checkpoint(ckpt, tmp_path / "o5", tokenizer_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    assert export_checkpoint(ckpt, tmp_path / "empty").name == "empty"  # an empty dir is fine

    incomplete = tmp_path / "run" / "checkpoints" / "step_9"
    incomplete.mkdir()
    assert main([str(incomplete), str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "not a complete checkpoint" in err and "step_4" in err
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "o3")]) == 2
    assert "does not exist" in capsys.readouterr().err

    # damaged weights whose sizes still match the manifest: validation catches the wrong shapes
    cfg_path = ckpt / "actor" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_hidden_layers"] = 5
    cfg_path.write_text(json.dumps(cfg).ljust(cfg_path.stat().st_size)[: cfg_path.stat().st_size])
    with pytest.raises(ExportError, match=r"missing \['model.layers.4"):
        export_checkpoint(ckpt, tmp_path / "o4")
    assert not (tmp_path / "o4").exists()


def test_cli_subprocess(tmp_path, capsys):
    _checkpoint(tmp_path / "run", critic=False)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "launcher.export", str(tmp_path / "run" / "checkpoints"),
                           str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "exported actor" in proc.stdout and (tmp_path / "out" / "config.json").exists()
    assert (tmp_path / "out" / "tokenizer.json").exists()
    # the refusal in-process (main's return is the exit code, as the run above shows; a second interpreter
    # would only start torch again)
    assert main([str(tmp_path / "run"), str(tmp_path / "out")]) == 2 and "not empty" in capsys.readouterr().err


def test_export_writes_the_runs_tokenizer_by_default(tmp_path, capsys):
    """No --tokenizer: the run's own tokenizer (config.yaml: model.tokenizer / model.path) is copied in;
    a run on builtin:char gets a note naming the flag."""
    from launcher.config.load import load_config, to_yaml

    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_text("{}")
    (base / "tokenizer_config.json").write_text("{}")
    run = tmp_path / "run"
    _checkpoint(run, critic=False)
    (run / "config.yaml").write_text(to_yaml(load_config(None, [f"model.path={base}"])))
    out = export_checkpoint(run, tmp_path / "hf")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json"}
    assert f"tokenizer from {base}" in capsys.readouterr().out
    assert main([str(run), str(tmp_path / "bare"), "--no-tokenizer"]) == 0
    assert {p.name for p in (tmp_path / "bare").iterdir()} == {"config.json", "model.safetensors"}
    assert "note" not in capsys.readouterr().out

    (run / "config.yaml").write_text(to_yaml(load_config(None, ["model.tokenizer=builtin:char"])))
    assert main([str(run), str(tmp_path / "char")]) == 0
    assert "note: no tokenizer written: the run used the built-in tokenizer 'builtin:char'" in capsys.readouterr().out
    assert not (tmp_path / "char" / "tokenizer.json").exists()
