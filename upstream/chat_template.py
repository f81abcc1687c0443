"""A checkpoint's chat template, applied by Gantry before a prompt reaches Triton.

Both LLM routes take plain text (the TensorRT-LLM ensemble's text_input does
not apply a template), so chat messages become one prompt here, the way
transformers' ``apply_chat_template`` renders it: the Jinja template from the
checkpoint's tokenizer files, in a sandbox, with ``messages``,
``add_generation_prompt``, the special tokens, ``raise_exception`` and
``strftime_now``. The template was read when the checkpoint was inspected
(upstream.checkpoints), so the web tier never loads a tokenizer.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import ValidationFailed

# The roles a chat message may take (the API refuses others before any template runs).
ROLES = ("system", "user", "assistant", "tool")


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


@lru_cache(maxsize=64)
def _compile(template: str) -> Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # noqa: DTZ005 - as transformers
    return environment.from_string(template)


def render(
    template: str,
    messages: list[dict[str, Any]],
    *,
    special_tokens: dict[str, str] | None = None,
    add_generation_prompt: bool = True,
    model_name: str = "this model",
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt for ``messages`` (and ``tools``, OpenAI's tool definitions, as
    transformers passes them); ValidationFailed naming ``messages`` when the
    checkpoint has no template or the template refuses them."""
    if not template:
        raise ValidationFailed(
            {"messages": f"{model_name} has no chat template in its tokenizer files: send a plain prompt instead"}
        )
    try:
        return _compile(template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **(special_tokens or {})
        )
    except _TemplateRaised as exc:
        raise ValidationFailed({"messages": f"{model_name}'s chat template refused them: {exc}"}) from exc
    except TemplateError as exc:
        raise ValidationFailed({"messages": f"{model_name}'s chat template failed: {exc}"}) from exc
