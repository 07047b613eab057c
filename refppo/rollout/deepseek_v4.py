"""DeepSeek-V4's prompt encoding, which verl's continuous-token rollouts use in place of a chat
template (``data.continuous_token.enable=true`` with ``model_family=deepseekv4``).

DeepSeek-V4 marks turns with its own special tokens instead of a role/content markup: a run of
user (or tool-result) messages is one user turn, an assistant turn ends with the end-of-sentence
token, and the thinking block is opened or closed right after the assistant token. The checkpoint
ships no usable chat template, so verl renders prompts with its port of the model's encoder
(verl 0.9: ``verl/utils/tokenizer/deepseek.py``, ``encode_messages``); this module writes the same
text for the messages a single-turn prompt holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
# prepended in thinking mode when reasoning_effort is "max" or "xhigh"
MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
# roles whose consecutive messages share one user turn
USER_RUN = ("user", "tool")
ROLES = ("system", "developer", "user", "tool", "assistant", "latest_reminder")
# message fields of the tool-calling encoder that a single-turn prompt never needs
TOOL_FIELDS = ("tools", "tool_calls", "response_format", "task")


def message_text(content) -> str:
    """A message's content as text: a string, or the text parts of a list of typed parts
    (``{"type": "text", "text": ...}``); None is empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if part.get("type") == "text")
    return str(content)


def encode_messages(messages: Sequence[Mapping], chat_template_kwargs: Mapping | None = None) -> str:
    """The DeepSeek-V4 prompt of a chat, with the assistant's turn opened, as verl renders it.

    ``chat_template_kwargs`` (verl's ``data.apply_chat_template_kwargs``) are read as verl's
    ``DeepSeekV4ContinuousTokenBuilder`` reads them: ``enable_thinking`` (or ``thinking``) opens a
    thinking block after the assistant token instead of closing it; ``drop_thinking`` (default
    true) keeps an assistant message's ``reasoning_content`` only after the last user turn;
    ``reasoning_effort`` "max" or "xhigh" prepends the maximum-effort preamble in thinking mode and
    "none" turns thinking off.

    Args:
        messages: the chat: N ``{"role", "content"}`` messages, roles among :data:`ROLES`.
        chat_template_kwargs: the keyword arguments above; others are not read.

    Returns:
        The prompt text, beginning with the BOS token and ending with the opened assistant turn.

    Raises:
        ValueError: not a list of messages; naming the message: one that is not a mapping, a role
            outside :data:`ROLES`, or a tool-calling field.
    """
    kwargs = dict(chat_template_kwargs or {})
    effort = kwargs.get("reasoning_effort")
    thinking = bool(kwargs.get("enable_thinking") or kwargs.get("thinking")) and effort != "none"
    drop_thinking = bool(kwargs.get("drop_thinking", True))
    if isinstance(messages, (str, Mapping)):
        raise ValueError("messages must be a list of {role, content} messages, got one text or message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} is not a {{role, content}} message: {message!r}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i}: DeepSeek-V4's encoding has no role {role!r} (roles: {', '.join(ROLES)})")
        if fields := [f for f in TOOL_FIELDS if message.get(f)]:
            raise ValueError(
                f"message {i} has {', '.join(fields)}: refppo encodes DeepSeek-V4 prompts without tool "
                "schemas, tool calls, response formats or quick-instruction tasks"
            )
    user_turns = [i for i, m in enumerate(messages) if m["role"] in (*USER_RUN, "developer")]
    last_user = max(user_turns, default=-1)

    parts = [BOS]
    if thinking and effort in ("max", "xhigh"):
        parts.append(MAX_EFFORT)
    for i, message in enumerate(messages):
        role = message["role"]
        text = message_text(message.get("content"))
        if role == "system":
            parts.append(text)
        elif role == "developer":  # a system prompt carried in a user turn
            parts.append(USER + text)
        elif role == "latest_reminder":
            parts.append(LATEST_REMINDER + text)
        elif role in USER_RUN:
            continues_turn = i > 0 and messages[i - 1]["role"] in USER_RUN
            parts.append("\n\n" if continues_turn else USER)
            parts.append(f"<tool_result>{text}</tool_result>" if role == "tool" else text)
        else:  # an assistant turn; its reasoning is kept in thinking mode unless dropped
            parts.append(ASSISTANT)
            if thinking and (not drop_thinking or i > last_user):
                reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
                parts.append(THINK_START + reasoning)
            parts.append(THINK_END + text + EOS)
    parts.append(ASSISTANT + (THINK_START if thinking else THINK_END))
    return "".join(parts)
