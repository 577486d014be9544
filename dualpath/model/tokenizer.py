"""Tokenizer and chat template of an HF model folder, without ``transformers``.

Reads ``tokenizer.json`` with the ``tokenizers`` library and renders the chat template
(``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``) with a sandboxed
Jinja environment, as HF's ``apply_chat_template`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from dualpath.errors import ModelLoadError


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise ModelLoadError(f"chat template error: {message}")


class Tokenizer:
    """Encode, decode and chat-format text for one model folder."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} does not exist")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template_path = model_dir / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else None
        self.chat_template: str | None = template or cfg.get("chat_template")
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = _raise_exception

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token, when the folder names one."""
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``."""
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool = True) -> str:
        """The prompt text the chat template makes of ``messages``."""
        if not self.chat_template:
            raise ModelLoadError("this model has no chat template; use a raw prompt")
        template = self._env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the chat-formatted prompt, ready for generation."""
        return self.encode(self.render_chat(messages))
