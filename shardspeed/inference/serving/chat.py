"""Turn chat ``messages`` into one prompt.

With a tokenizer that has a chat template (``tokenizer.chat_template`` or the
``chat_template`` override), the template renders the conversation and the result is
tokenized here without extra special tokens (the template already holds them).
Without one, the fallback template is plain text, one message per line, ending with
an open assistant turn::

    system: You are terse.
    user: Hi!
    assistant:
"""

from __future__ import annotations

from typing import Any


def has_chat_template(tokenizer: Any, chat_template: str | None = None) -> bool:
    """True when ``tokenizer`` can render a chat template."""
    if tokenizer is None or not callable(getattr(tokenizer, "apply_chat_template", None)):
        return False
    return bool(chat_template or getattr(tokenizer, "chat_template", None))


def render_chat_prompt(
    messages: list[dict[str, str]], tokenizer: Any, chat_template: str | None = None
) -> str | list[int]:
    """The prompt for ``messages``: token ids when a chat template is used, else text."""
    if has_chat_template(tokenizer, chat_template):
        text = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])
