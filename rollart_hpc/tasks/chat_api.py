"""One episode's OpenAI-style chat conversation, kept as token ids (the chat-completions endpoint's core).

An agent written against the OpenAI chat-completions API sends the whole conversation with every
request. `Conversation` turns each request into exactly the token ids that extend the episode's
`Trajectory`, never re-tokenizing what the trajectory already holds:

- the first request's messages (and its `tools`) are rendered with the chat template, generation
  prompt included, and appended with mask 0 (`ChatTokens.prompt_ids`);
- a later request must repeat the recorded conversation (every earlier message, including the assistant
  messages this conversation returned) and add at least one message (tool results, user messages); the
  recorded prefix is not tokenized again: only the template text that closes the last assistant turn and
  carries the new messages up to the next generation prompt is appended, with mask 0 (the string
  difference of two renderings, as `ChatTokens.continuation_ids` does);
- each generation's sampled ids, log-probs and versions are appended verbatim with mask 1.
A request whose messages do not extend the recorded conversation (an edited history) or whose tools differ
from the first request's is refused (`ChatRequestError`, HTTP 400).

Tool calls. A tokenizer whose chat template handles tools natively (its template mentions `tools`) gets
them through `apply_chat_template(..., tools=...)`. Any other template (the tiny model's) gets the
Qwen/Hermes convention written out: the tool signatures in a `# Tools` block appended to the system
message, a call written by the model as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a
`role: "tool"` message rendered as a user turn `<tool_response>\\n...\\n</tool_response>`. Generated text
is parsed for `<tool_call>` blocks in both cases; a block that is not a JSON object with a string `name`
and an object `arguments` makes the whole reply plain content (`malformed` is set, never an error).
Assistant turns this conversation generated are always rendered as their generated text (so the
template reproduces exactly what was sampled).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from rollart_hpc.contracts.generation import RequestOutput
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.tasks.chat import ChatTokens

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


@dataclass(frozen=True)
class AgentOutcome:
    """What an OpenAI-client agent may return instead of a bare float: the episode's `reward` and
    whether it counts as a `success` (None: success is reward > 0)."""

    reward: float
    success: bool | None = None

    @property
    def won(self) -> bool:
        return self.reward > 0 if self.success is None else bool(self.success)


class ChatRequestError(Exception):
    """A request the endpoint refuses: HTTP `status`, an OpenAI-style error `code`, one-line message."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _text(content: Any, where: str) -> str:
    """Message content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ChatRequestError(400, f"{where}.content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatRequestError(400, f"{where}.content must be a string, null or a list of text parts")


def _arguments(raw: Any) -> Any:
    """Tool-call arguments compared by value: a JSON string is parsed (whitespace is not a difference)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def canonical(message: Any, where: str) -> dict[str, Any]:
    """The fields of one request message that the conversation records and compares."""
    if not isinstance(message, dict):
        raise ChatRequestError(400, f"{where} must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise ChatRequestError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    out["content"] = _text(message.get("content"), where)
    if role == "assistant":
        calls = []
        for i, call in enumerate(message.get("tool_calls") or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ChatRequestError(400, f"{where}.tool_calls[{i}] needs function.name")
            calls.append(
                {"id": call.get("id"), "name": fn["name"], "arguments": _arguments(fn.get("arguments"))}
            )
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's `tools` (OpenAI function tools), checked."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatRequestError(400, "tools must be a list")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise ChatRequestError(
                400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
    return list(tools)


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The Qwen/Hermes tools section of the system message (templates without native tool support)."""
    return TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FOOTER


def parse_tool_calls(text: str, turn: int) -> tuple[str, list[dict[str, Any]], bool]:
    """(content, tool calls in OpenAI form, malformed) of a generated text."""
    blocks = TOOL_CALL.findall(text)
    if not blocks:
        return text, [], False
    calls = []
    for i, block in enumerate(blocks):
        try:
            obj = json.loads(block)
        except ValueError:
            return text, [], True
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, [], True
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            return text, [], True
        calls.append(
            {
                "id": f"call_{turn}_{i}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    return text[: text.index("<tool_call>")].strip(), calls, False


@dataclass
class Conversation:
    """The recorded chat of one episode and its trajectory (see the module docstring)."""

    chat: ChatTokens
    traj: Trajectory
    seen: list[dict[str, Any]] = field(default_factory=list)  # canonical messages, as the client repeats them
    rendered: list[dict[str, Any]] = field(default_factory=list)  # the same, as the template renders them
    tools: list[dict[str, Any]] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)  # the last turn's sampled ids
    rendered_first: list[dict[str, Any]] = field(default_factory=list)  # the first request, as rendered
    malformed_tool_calls: int = 0

    @property
    def native_tools(self) -> bool:
        return "tools" in str(self.chat.tokenizer.chat_template)

    def _render(self, messages: list[dict[str, Any]]) -> str:
        if self.tools and self.native_tools:
            return self.chat.render(messages, generation_prompt=True, tools=self.tools)
        return self.chat.render(messages, generation_prompt=True)

    def _template_form(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A canonical message as the chat template is given it."""
        role, content = msg["role"], msg["content"]
        if self.native_tools:
            out: dict[str, Any] = {"role": role, "content": content}
            if msg.get("tool_calls"):
                out["tool_calls"] = [
                    {
                        "type": "function",
                        "id": c["id"],
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in msg["tool_calls"]
                ]
            if role == "tool" and msg.get("tool_call_id"):
                out["tool_call_id"] = msg["tool_call_id"]
            return out
        if role == "tool":
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        for call in msg.get("tool_calls") or []:
            body = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
            content += f"\n<tool_call>\n{body}\n</tool_call>"
        return {"role": role, "content": content}

    def _template_messages(self, messages: list[dict[str, Any]], first: bool) -> list[dict[str, Any]]:
        out = [self._template_form(m) for m in messages]
        if first and self.tools and not self.native_tools:
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools_block(self.tools)}
            else:
                out.insert(0, {"role": "system", "content": tools_block(self.tools)})
        return out

    def extend(self, messages: Any, tools: Any) -> tuple[list[int], list[dict[str, Any]]]:
        """The mask-0 ids a request adds to the trajectory and its new messages (canonical); raises
        `ChatRequestError` for a request that does not extend the conversation. Records nothing."""
        if not isinstance(messages, list) or not messages:
            raise ChatRequestError(400, "messages must be a non-empty list")
        msgs = [canonical(m, f"messages[{i}]") for i, m in enumerate(messages)]
        tools = check_tools(tools)
        n = len(self.seen)
        if not self.seen:
            self.tools = tools
        elif tools != self.tools:
            raise ChatRequestError(400, "tools differ from this episode's first request (edited history)")
        for i, (old, new) in enumerate(zip(self.seen, msgs, strict=False)):
            if old != new:
                raise ChatRequestError(
                    400,
                    f"messages[{i}] differs from this episode's recorded conversation (edited history): "
                    "a request must repeat every earlier message, the returned assistant messages included",
                )
        added = msgs[n:]
        if not added:
            raise ChatRequestError(400, "messages add nothing to this episode's recorded conversation")
        if added[-1]["role"] == "assistant":
            raise ChatRequestError(400, "the last message must not be an assistant message")
        if not self.seen:
            self.rendered_first = self._template_messages(added, first=True)
            return self.chat.encode(self._render(self.rendered_first)), added
        return self._continuation(self._template_messages(added, first=False)), added

    def _continuation(self, new: list[dict[str, Any]]) -> list[int]:
        assistant = self.chat.assistant_content(self.generated)
        base = self._render(self.rendered[:-1]) + assistant
        full = self._render([*self.rendered, *new])
        if not full.startswith(base):
            raise ChatRequestError(
                400, "the chat template is not prefix-stable: it rewrites an earlier turn", "unsupported"
            )
        suffix = full[len(base) :]
        if self.chat.ends_with_stop(self.generated):
            stop_text = self.chat.tokenizer.convert_ids_to_tokens(self.generated[-1])
            if suffix.startswith(stop_text):
                suffix = suffix[len(stop_text) :]
        return self.chat.encode(suffix)

    def record(
        self,
        prompt: list[int],
        added: list[dict[str, Any]],
        out: RequestOutput,
        turn: int,
        tools: bool = True,
    ) -> tuple[dict[str, Any], str]:
        """Append one turn (its mask-0 `prompt` ids and the engine's output); the assistant message to
        return (tool calls parsed unless `tools` is False: tool_choice "none") and its text (the action)."""
        first = not self.seen
        self.traj.append(list(prompt), False, [], [])
        if first:
            self.traj.prompt_len = len(self.traj.token_ids)
        self.traj.append(list(out.token_ids), True, list(out.logprobs), list(out.versions))
        text = self.chat.assistant_text(out.token_ids)
        content, calls, malformed = parse_tool_calls(text, turn) if tools else (text, [], False)
        self.malformed_tool_calls += int(malformed)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        self.seen.extend([*added, canonical(message, "reply")])
        rendered = self.rendered_first if first else self._template_messages(added, first=False)
        raw = self.chat.assistant_content(out.token_ids)
        self.rendered.extend([*rendered, {"role": "assistant", "content": raw}])
        self.generated = list(out.token_ids)
        return message, text
