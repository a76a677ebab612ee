"""Export one model role of a checkpoint as a Hugging Face directory.

    python -m launcher.export runs/<name>/checkpoints/step_N <out_dir> [--role actor|critic] [--dtype bf16]
                              [--tokenizer <dir> | --no-tokenizer]
    python -m launcher.export runs/<name> <out_dir>          # the newest complete checkpoint of the run
    python -m launcher.export runs/<name> <out_dir> --role actor_adapter   # a LoRA actor's PEFT adapter

The tokenizer files are copied in by default from the tokenizer the run trained with (its
config.yaml: model.tokenizer, or model.path's tokenizer); a run on the built-in character
tokenizer has none to copy, which export says, with the flag that supplies one.

Checkpoints already store each role as an HF directory (config.json + safetensors, see
ppo/run/checkpoint.py), so export is a verified copy: the checkpoint must be complete (manifest
present, every file its recorded size), the role's tensor names and shapes must match the
model its config.json describes, and the copy is checked file by file. `--dtype` re-encodes the
floating weights instead (e.g. fp32 master weights -> bf16). Errors exit with code 2.
The result loads with `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` (critic:
AutoModelForSequenceClassification) and with `models.load_pretrained(out_dir)`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from models.config import ModelConfig, ModelConfigError
from models.heads import LlamaForSequenceClassification
from models.hf_io import load_tensors, save_tensors, tensor_shapes
from models.llama import LlamaForCausalLM
from ppo.run.checkpoint import ADAPTER_ROLE, find_latest_checkpoint, hf_weight_files, list_checkpoints, read_manifest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")
DTYPES = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CLASSES = {"ForCausalLM": LlamaForCausalLM, "ForSequenceClassification": LlamaForSequenceClassification}


class ExportError(ValueError):
    """A checkpoint or destination the export cannot use; the message says what to do."""


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A complete checkpoint dir, or the newest complete one of a run dir / its checkpoints/ dir."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"{p} does not exist")
    if read_manifest(p) is not None:
        return p
    run_dir = p.parent if p.name == "checkpoints" else p
    if (run_dir / "checkpoints").is_dir() and (latest := find_latest_checkpoint(run_dir)) is not None:
        return latest
    complete = [c.name for c in list_checkpoints(p.parent.parent)] if p.parent.name == "checkpoints" else []
    raise ExportError(f"{p} is not a complete checkpoint (no valid COMPLETE manifest: the save was interrupted "
                      f"or files were changed) nor a run dir with one; complete checkpoints beside it: "
                      f"{complete or 'none'}")


def expected_shapes(config: dict) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(architecture suffix, {HF name: shape}) of the model a config.json describes."""
    arch = (config.get("architectures") or ["?"])[0]
    suffix = arch[arch.find("For"):] if "For" in arch else arch
    if suffix not in _CLASSES:
        raise ExportError(f"config.json architectures={config.get('architectures')}: export supports "
                          f"{', '.join('<Family>' + s for s in _CLASSES)}")
    cfg = ModelConfig.from_hf(config)
    with torch.device("meta"):
        model = _CLASSES[suffix](cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # HF tied checkpoints carry the embedding only
    return suffix, shapes


def validate_hf_dir(model_dir: Path) -> tuple[str, int]:
    """Check an HF directory is complete and matches its config. -> (architecture suffix, #tensors)."""
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"{model_dir} has no config.json: the checkpoint was saved without model_configs "
                          "for this role, so the architecture is unknown; re-save with model_configs")
    try:
        config = json.loads(cfg_file.read_text())
        suffix, want = expected_shapes(config)
    except (ValueError, ModelConfigError) as err:
        raise ExportError(f"{cfg_file}: {err}") from err
    try:
        hf_weight_files(model_dir)
        have = tensor_shapes(model_dir)
    except (FileNotFoundError, ModelConfigError) as err:
        raise ExportError(str(err)) from err
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    wrong = sorted(n for n in set(want) & set(have) if tuple(want[n]) != tuple(have[n]))
    if missing or extra or wrong:
        raise ExportError(f"{model_dir} does not match its config.json ({suffix}): missing {missing[:5]}, "
                          f"unexpected {extra[:5]}, wrong shape {[(n, have[n], want[n]) for n in wrong[:5]]}")
    return suffix, len(have)


def tokenizer_files(tokenizer_dir: str | os.PathLike | None) -> list[Path]:
    """The Hugging Face tokenizer files present in `tokenizer_dir` (e.g. the base model's directory)."""
    if tokenizer_dir is None:
        return []
    files = [Path(tokenizer_dir) / f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file()]
    if not files:
        raise ExportError(f"no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...) in {tokenizer_dir}")
    return files


def run_tokenizer_dir(ckpt: Path) -> tuple[str | None, str]:
    """(the tokenizer directory the checkpoint's run trained with, or None; why) from the run's config.yaml."""
    from omegaconf import OmegaConf

    from ppo.data.tokenizer import resolve_tokenizer

    cfg_file = ckpt.parent.parent / "config.yaml"
    if not cfg_file.is_file():
        return None, f"no {cfg_file} to tell which tokenizer the run used"
    model = OmegaConf.to_container(OmegaConf.load(cfg_file)).get("model", {})
    spec = resolve_tokenizer(model.get("tokenizer", "auto"), model.get("path"))
    if spec.startswith("builtin:"):
        return None, f"the run used the built-in tokenizer {spec!r}, which has no Hugging Face files"
    if not Path(spec).is_dir():
        return None, f"the run's tokenizer directory {spec} no longer exists"
    return spec, f"the run's tokenizer ({spec})"


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    role: str = "actor",
    dtype: torch.dtype | None = None,
    tokenizer_dir: str | os.PathLike | None = "auto",
) -> Path:
    """Write `role` of a checkpoint (or of a run's newest checkpoint) to `out_dir` as an HF directory,
    with the tokenizer files of `tokenizer_dir` copied in: "auto" (the run's own tokenizer, when it
    has files), a directory, or None (no tokenizer)."""
    ckpt = resolve_checkpoint(checkpoint)
    note = None
    if tokenizer_dir == "auto":
        tokenizer_dir, why = run_tokenizer_dir(ckpt) if role == "actor" else (None, "")
        if tokenizer_dir is None and role == "actor":
            note = (f"note: no tokenizer written: {why}; pass --tokenizer <dir with tokenizer.json> to add one "
                    f"(--no-tokenizer silences this)")
    manifest = read_manifest(ckpt)
    if role not in manifest["roles"]:
        with_role = [c.name for c in list_checkpoints(ckpt.parent.parent) if role in read_manifest(c)["roles"]]
        raise ExportError(f"{ckpt} has no {role!r} weights; roles saved: {manifest['roles'] or 'none'}; "
                          f"checkpoints of this run with {role!r} weights: {with_role or 'none'} "
                          "(full weights are written only by saves given model_states, e.g. the final one)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty; choose a new directory or remove it")
    src = ckpt / role
    if role == ADAPTER_ROLE:
        return _export_adapter(src, out, dtype=dtype, step=manifest["step"])
    suffix, n_tensors = validate_hf_dir(src)
    extra = tokenizer_files(tokenizer_dir)
    if dtype is not None:
        cfg = ModelConfig.from_hf(json.loads((src / "config.json").read_text()))
        save_tensors(load_tensors(src, dtype=dtype), cfg, out, architecture=suffix, extra_files=extra)
    else:
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(src, tmp)
            for f in src.rglob("*"):
                if f.is_file() and (tmp / f.relative_to(src)).stat().st_size != f.stat().st_size:
                    raise ExportError(f"copy of {f} is incomplete (disk full?); nothing was exported")
            for f in extra:
                shutil.copy2(f, tmp / f.name)
            if out.exists():
                out.rmdir()  # empty (checked above); rename onto it needs it gone
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    validate_hf_dir(out)
    with_tok = f", tokenizer from {tokenizer_dir}" if extra else ""
    print(f"exported {role} of {ckpt} (step {manifest['step']}, {n_tensors} tensors, {suffix}{with_tok}) to {out}")
    if note:
        print(note)
    return out


def _export_adapter(src: Path, out: Path, *, dtype: torch.dtype | None, step: int) -> Path:
    """A LoRA actor's PEFT adapter directory, verified (models.lora.read_peft_adapter) and copied as it is."""
    from models.lora import read_peft_adapter

    if dtype is not None:
        raise ExportError("--dtype re-encodes model weights; a LoRA adapter is exported as it was trained (fp32)")
    try:
        spec, tensors = read_peft_adapter(src)
    except (ValueError, OSError) as e:
        raise ExportError(f"{src}: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        shutil.copy2(f, out / f.name)
    read_peft_adapter(out)
    print(f"exported {ADAPTER_ROLE} (step {step}, r={spec.rank}, alpha={spec.alpha}, {len(tensors)} tensors) to {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launcher.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="runs/<name>/checkpoints/step_N, or runs/<name> for the newest")
    ap.add_argument("out_dir")
    ap.add_argument("--role", default="actor", help="model role to export (actor, critic, actor_adapter)")
    ap.add_argument("--dtype", default="keep", choices=sorted(DTYPES), help="re-encode floating weights")
    tok = ap.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default="auto",
                     help="directory whose tokenizer files are copied in (default: the run's own tokenizer)")
    tok.add_argument("--no-tokenizer", dest="tokenizer", action="store_const", const=None,
                     help="write the weights and config only")
    args = ap.parse_args(argv)
    try:
        export_checkpoint(args.checkpoint, args.out_dir, role=args.role, dtype=DTYPES[args.dtype],
                          tokenizer_dir=args.tokenizer)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
