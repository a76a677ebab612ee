"""Loading: YAML files + `key=value` overrides via OmegaConf -> a validated Config.

    cfg = load_config("conf/ppo_tiny.yaml", ["actor.lr=1e-5", "placement.mode=split"])

A YAML file may extend others: `extends: base.yaml` (or a list), paths relative to the
file. Unknown keys fail with the dotted path and the closest valid names (a key that was
removed or renamed: what to write instead, RETIRED_KEYS); wrong types name the source (file
or command line), the key and the expected type. Everything here runs before any process
group exists, so a bad config costs nothing and exits with 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any

from launcher.config.auto import resolve_auto
from launcher.config.schema import Config
from launcher.config.validation import validate_config
from launcher.errors import UserError

_FORWARD_ONLY = "runs forwards only: it keeps no activations for a backward to recompute"
# keys that no longer exist -> what to write instead (the closest name may be another mechanism: actor.offload is
# not actor.offload_optimizer)
RETIRED_KEYS = {
    "actor.offload": "renamed actor.offload_optimizer_while_generating (the optimizer states to host memory while "
                     "the rollout generates; actor.offload_optimizer keeps them there all the time)",
    "critic.offload": "only the actor offloads its optimizer while the rollout generates on its GPUs; "
                      "critic.offload_optimizer keeps the critic's Adam moments in host memory all the time",
    "ref.offload": "the reference has no optimizer to offload",
    "reward.offload": "the reward role has no optimizer to offload",
    "ref.activation_checkpointing": f"the reference {_FORWARD_ONLY}",
    "reward.type": "a reward model is its own section now: reward.model.path=DIR (its layout: reward.model.tp, ...); "
                   "without reward.model the rule function (reward.function) scores",
    "reward.model_path": "moved to reward.model.path",
    **{f"reward.{k}": f"a reward model's layout is under reward.model: reward.model.{k} (a rule function has none)"
       for k in ("tp", "pp", "dp", "pp_microbatches", "pp_schedule", "pp_stages_per_rank", "compile", "backend",
                 "max_tokens_per_micro_batch")},
    "reward.activation_checkpointing": f"the reward model {_FORWARD_ONLY}",
    "trainer.async_rollout": "replaced by trainer.max_staleness (the staleness bound K in steps): "
                             "async_rollout=true is trainer.max_staleness=1, false is 0",
}


def _unwrap(t: Any) -> Any:
    """A list's element type, an optional section's class (RewardModelConfig | None -> RewardModelConfig)."""
    if typing.get_origin(t) is list:
        return typing.get_args(t)[0]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else t


def _fields_at(path: list[str]) -> list[str]:
    """Valid field names of the schema node at a dotted path (for "did you mean")."""
    cls: Any = Config
    for part in path:
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return []
        t = _unwrap(hints[part])
        if not dataclasses.is_dataclass(t):
            return []
        cls = t
    return [f.name for f in dataclasses.fields(cls)]


def _explain(err: Exception, source: str) -> UserError:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    full_key = getattr(err, "full_key", None) or ""
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        parts = [p for p in full_key.replace("[", ".").replace("]", "").split(".") if p and not p.isdigit()]
        if ".".join(parts) in RETIRED_KEYS:
            return UserError(f"{source}: unknown config key '{full_key}': {RETIRED_KEYS['.'.join(parts)]}")
        key = parts[-1] if parts else full_key
        valid = _fields_at(parts[:-1])
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr('.'.join(parts[:-1] + [c])) for c in close)}?" if close else ""
        choices = f" Valid keys here: {', '.join(valid)}." if valid and not close else ""
        return UserError(f"{source}: unknown config key '{full_key}'{hint}{choices}")
    if isinstance(err, ValidationError):
        want = ""
        parts = full_key.split(".")
        cls: Any = Config
        try:
            for p in parts[:-1]:
                cls = typing.get_type_hints(cls)[p]
            t = typing.get_type_hints(cls)[parts[-1]]
            want = f" (expected {getattr(t, '__name__', t)})"
        except (KeyError, TypeError):
            pass
        msg = str(err).splitlines()[0]
        return UserError(f"{source}: bad value for '{full_key}'{want}: {msg}")
    return UserError(f"{source}: {err}")


def _list_fields(cls: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: element type} of every list-typed field of the schema (list[str], list[float], ...)."""
    out: dict[str, Any] = {}
    for name, t in typing.get_type_hints(cls).items():
        if typing.get_origin(t) is list:
            out[prefix + name] = typing.get_args(t)[0]
        elif dataclasses.is_dataclass(_unwrap(t)):
            out.update(_list_fields(_unwrap(t), f"{prefix}{name}."))
    return out


def _coerce_lists(node: Any, source: str) -> Any:
    """A single value given for a list of strings becomes a one-element list (`data.train_files=a.jsonl`
    means [a.jsonl]); for other lists a single value is an error that says what to write."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(node, DictConfig):
        return node
    tree = OmegaConf.to_container(node, resolve=False)
    changed = False
    for key, elem in _list_fields(Config).items():
        cur: Any = tree
        parts = key.split(".")
        for p in parts[:-1]:
            cur = cur.get(p) if isinstance(cur, dict) else None
        if not isinstance(cur, dict) or parts[-1] not in cur:
            continue
        value = cur[parts[-1]]
        if value is None or isinstance(value, list | tuple | dict):
            continue
        if elem is str:
            cur[parts[-1]], changed = [value], True
        else:
            example = {float: "[0.9,0.95]", int: "[1,2]"}.get(elem, "[...]")
            raise UserError(f"{source}: '{key}' is a list; write {key}={example} (got {value!r})")
    return OmegaConf.create(tree) if changed else node


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()):
    """YAML file -> list of (source, DictConfig) in merge order, bases first."""
    from omegaconf import OmegaConf

    path = path.resolve()
    if path in seen:
        raise UserError(f"{path}: 'extends' cycle: {' -> '.join(str(p) for p in seen + (path,))}")
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        node = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - yaml errors come in many types
        raise UserError(f"{path}: cannot parse YAML: {e}") from None
    if not hasattr(node, "keys"):  # a list, or a scalar: not a config
        raise UserError(f"{path}: the top level of a config file must be a mapping of sections (trainer:, actor:, "
                        f"...), not a {type(node).__name__.replace('ListConfig', 'list')}")
    if len(node) == 0:
        raise UserError(f"{path}: the config file is empty; it needs at least one section (e.g. trainer:) or an "
                        f"'extends: ppo_tiny.yaml' line (every key left out takes its schema default)")
    out = []
    bases = node.pop("extends", None) if hasattr(node, "pop") else None
    for base in [bases] if isinstance(bases, str) else list(bases or []):
        out += _read_yaml(path.parent / base, seen + (path,))
    out.append((str(path), node))
    return out


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = (), *,
                auto_choices: list[str] | None = None) -> Config:
    """Merge YAML (with its bases) and `key=value` overrides onto the schema, validate, resolve the unset
    settings (launcher.config.auto; their lines appended to `auto_choices`), return a Config."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = OmegaConf.structured(Config)
    sources = _read_yaml(Path(path)) if path else []
    for bad in [o for o in overrides if "=" not in o]:
        raise UserError(f"command line: override {bad!r} must look like key=value (e.g. actor.tp=2)")
    for o in overrides:
        try:
            sources.append(("command line", OmegaConf.from_dotlist([o])))
        except Exception as e:  # noqa: BLE001 - yaml scanner errors for malformed values
            raise UserError(f"command line: cannot parse override {o!r} as YAML "
                            f"(flow mappings need a space after ':', e.g. {{roles: [actor], size: 1}}): "
                            f"{str(e).splitlines()[0]}") from None
    for source, node in sources:
        node = _coerce_lists(node, source)
        try:
            cfg = OmegaConf.merge(cfg, node)
        except OmegaConfBaseException as e:
            raise _explain(e, source) from None
    obj: Config = OmegaConf.to_object(cfg)
    validate_config(obj)
    choices = resolve_auto(obj)
    if auto_choices is not None:
        auto_choices.extend(choices)
    return obj


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
