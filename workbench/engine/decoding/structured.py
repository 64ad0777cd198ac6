"""Answers as data: `chat_json`'s checks around a grammar-constrained chat, and the
system message that shows the model the schema (as OpenAI's structured outputs do).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from workbench.engine.decoding.closing import ClosedEarlyWarning
from workbench.engine.decoding.grammar import Grammar, resolve_grammar
from workbench.engine.results import IncompleteOutputError


def with_schema_instruction(messages: Sequence[Mapping[str, Any]], schema: Any
                            ) -> list[dict[str, Any]]:
    """A copy of `messages` whose system message (added when there is none) asks for JSON
    following `schema`, as OpenAI's structured outputs show the schema to the model."""
    messages = [dict(m) for m in messages]
    instruction = ("Answer with a JSON object that follows this JSON Schema:\n"
                   + json.dumps(schema, ensure_ascii=False))
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0].get('content') or ''}\n\n{instruction}"
    else:
        messages.insert(0, {"role": "system", "content": instruction})
    return messages


def answer_json(model: Any, messages: Sequence[Mapping[str, Any]], schema: Any = None, *,
                grammar: Grammar | str | None = None, schema_in_prompt: bool = True,
                return_completion: bool = False, **options: Any) -> Any:
    """`model.chat_json`'s work (see `LLM.chat_json`) for any engine with a `chat` that
    takes `grammar=`."""
    if (schema is None) == (grammar is None):
        raise ValueError("chat_json needs a schema= or a grammar= (one of them)")
    if isinstance(schema, Grammar) and schema.kind != "json_schema":
        raise ValueError(f"chat_json's schema= takes a JSON Schema, got a {schema.kind} "
                         f"grammar (pass it as grammar=)")
    constraint = resolve_grammar(grammar, schema)
    if schema_in_prompt and constraint.schema is not None:
        messages = with_schema_instruction(messages, constraint.schema)
    completion = model.chat(messages, grammar=constraint, **options)
    text = completion.text
    if completion.finish_reason != "stop" and completion.closed_early != "budget":
        raise IncompleteOutputError(
            f"generation ended ({completion.finish_reason}) after "
            f"{completion.usage.completion_tokens} tokens, before the output was "
            f"complete: {text[:200]!r}; raise max_tokens")
    if completion.closed_early:
        warnings.warn(ClosedEarlyWarning(completion.closed_early, text), stacklevel=2)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if constraint.kind == "json_schema":  # a stop string cut it short
            raise IncompleteOutputError(f"the output is not complete JSON ({e}): "
                                        f"{text[:200]!r}") from None
        value = text
    if constraint.model is not None:
        value = constraint.model.model_validate(value)
    return (value, completion) if return_completion else value
