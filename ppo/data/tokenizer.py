"""Tokenizers without a transformers import: a built-in character tokenizer and local HF tokenizers.

    tok = load_tokenizer("builtin:char")             # CPU demo, no files needed, vocab fits 'tiny'
    tok = load_tokenizer("/models/Qwen2.5-0.5B")     # dir with tokenizer.json (+ tokenizer_config.json)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "2+3="}]))

A Hugging Face directory is read with the `tokenizers` library (tokenizer.json) and its
tokenizer_config.json: special tokens and the Jinja chat template, rendered the way transformers
renders it (sandboxed, trim_blocks, lstrip_blocks). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol, runtime_checkable


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used as asked."""


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_id: int | None
    pad_token_id: int | None
    bos_token_id: int | None
    vocab_size: int
    chat_template: str | None
    add_bos: bool  # plain-text prompts start with bos (chat templates write their own)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str: ...


class CharTokenizer:
    """One id per printable ASCII character (plus tab and newline), after 4 specials.

    ids: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, then the characters, then one id per hermes tool tag
    (<tool_call>, </tool_call>, <tool_response>, </tool_response>: a tool call costs a tiny model two
    tokens of markup, not 23): 105 ids in all, so it fits the 'tiny' preset (vocab 512; pad 0, bos 1,
    eos 2 as there). No chat template: chat messages are joined by the caller.
    """

    SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
    TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

    def __init__(self) -> None:
        chars = "".join(chr(c) for c in range(32, 127)) + "\t\n"
        self._id = {c: i + len(self.SPECIALS) for i, c in enumerate(chars)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2, 3
        tags = len(self.SPECIALS) + len(chars)
        self._tag_id = {t: tags + i for i, t in enumerate(self.TOOL_TAGS)}
        self.vocab_size = tags + len(self.TOOL_TAGS)
        self.chat_template: str | None = None
        self.add_bos = False
        # decode tables, id -> text ("" past the vocab: a model's vocab may be larger than this tokenizer's)
        self._text = {False: list(self.SPECIALS) + list(chars) + list(self.TOOL_TAGS),
                      True: [""] * len(self.SPECIALS) + list(chars) + list(self.TOOL_TAGS)}

    def encode(self, text: str) -> list[int]:
        if "<tool_" not in text and "</tool_" not in text:  # the common case: one id per character
            return [self._id.get(c, self.unk_token_id) for c in text]
        out: list[int] = []
        for part in _TAG_SPLIT.split(text):
            tag = self._tag_id.get(part)
            out.extend([tag] if tag is not None else [self._id.get(c, self.unk_token_id) for c in part])
        return out

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        text = self._text[bool(skip_special_tokens)]
        n = len(text)
        return "".join([text[i] if 0 <= i < n else "" for i in map(int, ids)])

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        raise TokenizerError("builtin:char has no chat template; give prompts as plain text")


_TAG_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in CharTokenizer.TOOL_TAGS) + ")")


def _token_text(v: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(v, dict):
        return v.get("content")
    return v


def _pick_template(tpl: Any) -> str | None:
    # newer configs list named templates: [{"name": "default", "template": ...}, ...]
    if isinstance(tpl, list):
        named = {t["name"]: t["template"] for t in tpl}
        return named.get("default", next(iter(named.values()), None))
    return tpl


class HFTokenizer:
    """A local Hugging Face tokenizer directory: tokenizer.json + tokenizer_config.json."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise TokenizerError(f"{path!r} has no tokenizer.json (only fast tokenizers are supported; "
                                 "convert with transformers' AutoTokenizer(...).save_pretrained(dir) once)")
        self.path = path
        self._tok = _Tok.from_file(tj)
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.pad_token = _token_text(cfg.get("pad_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        # no pad token: pad with eos (the usual choice; padding is always masked out)
        self.pad_token_id = self._id_of(self.pad_token)
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_id
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # Llama-style tokenizers prepend bos to plain text (add_bos_token); Qwen-style ones do not
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token_id is not None
        self.chat_template = _pick_template(cfg.get("chat_template"))
        jinja_path = os.path.join(path, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                self.chat_template = f.read()
        self._compiled = None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. Special tokens written in the text (from a chat template) are recognised;
        add_special_tokens=False (default) matches how transformers tokenizes a rendered template."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        """Many texts at once (the tokenizers library parallelises over them)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        if self.chat_template is None:
            raise TokenizerError(f"tokenizer at {self.path!r} has no chat_template in tokenizer_config.json")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     pad_token=self.pad_token or "", **extra)


def _compile_template(source: str):
    """Jinja environment like transformers' chat-template renderer (sandboxed, same helpers)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TokenizerError(f"chat template error: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
        # transformers' tojson does not HTML-escape (jinja2's built-in does)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def resolve_tokenizer(spec: str, model_path: str | None) -> str:
    """The tokenizer a run uses: `spec` as given, except "auto": model_path when that directory holds
    tokenizer.json, else builtin:char (a random-initialised model, or weights without a tokenizer)."""
    if spec != "auto":
        return spec
    if model_path and os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        return model_path
    return "builtin:char"


def load_tokenizer(path_or_name: str) -> CharTokenizer | HFTokenizer:
    """"builtin:char" -> CharTokenizer; a local directory with tokenizer.json -> HFTokenizer."""
    if path_or_name == "builtin:char":
        return CharTokenizer()
    if path_or_name.startswith("builtin:"):
        raise TokenizerError(f"unknown built-in tokenizer {path_or_name!r}; available: builtin:char")
    if os.path.isfile(path_or_name) and os.path.basename(path_or_name) == "tokenizer.json":
        path_or_name = os.path.dirname(path_or_name) or "."
    if not os.path.isdir(path_or_name):
        raise TokenizerError(f"tokenizer {path_or_name!r} is not a local directory (downloads are not supported; "
                             "point to a directory holding tokenizer.json, or use builtin:char)")
    return HFTokenizer(path_or_name)
