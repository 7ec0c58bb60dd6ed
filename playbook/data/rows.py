"""Rows of a dataset -> examples: token ids and masked labels, for every row format make_data reads
(playbook/data/dataset.py: chat, ShareGPT, prompt/completion, Alpaca, plain text), with the rows that
cannot be used counted by reason (DataReport).

Chat roles
----------
A message's role is one of ROLES (system, user, assistant, tool) or an alias of one (ROLE_ALIASES:
ShareGPT's human and gpt, function/observation/ipython for tool output, ...). Any other role stops the
build with the row, the role and the accepted names: a chat template renders an unknown role as a
header the model was never trained on (LLaMA 3's prints it verbatim), and an unknown role is
usually a whole file's naming convention, so counting such rows as dropped would hide the problem.

Examples longer than seq_len
----------------------------
An example is cut to its first seq_len tokens (`drop_long=False`, the default): the prompt stays whole
and the reply is cut at its end (for a chat, the later turns go first), and a cut reply has no
end-of-turn token, so the model is not taught to stop there. An example whose first seq_len tokens
hold no trained token (the prompt alone fills seq_len) is dropped as "prompt longer than seq_len".
`drop_long=True` drops every example longer than seq_len instead. The data line counts rows kept
whole, truncated and dropped, by reason.

Labels
------
`labels` are NOT shifted: the label at position t is the token at position t, or -100 where that token
is not trained on. Hugging Face's causal-LM loss shifts them inside the model (logits at t - 1 predict
label t). Masked (-100): every prompt token (for chat, every token that is not part of an assistant
reply, template headers included; for prompt/completion and Alpaca, the prompt), padding, and the
first token of every example, which no earlier token of the same example can predict. The last rule
makes `labels != -100` count exactly the tokens the loss is taken over, which is what a training loop
needs to normalise a loss summed over gradient-accumulation micro-batches. `train_on_prompt=True`
trains on every token of an example except its first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from playbook.data.files import DataError
from playbook.runtime.time_left import running  # (a long encoding says how far it is)

IGNORE_INDEX = -100  # Hugging Face's label value for "no loss here"

# Alpaca rows become a prompt in this layout; the model is trained on the output that follows it.
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"

# Why a row can be dropped; DataReport counts rows by these reasons.
DROP_REASONS = {
    "not an object": "the row is not a JSON object",
    "unknown shape": "none of messages, conversations, prompt/completion, instruction/output, text",
    "missing field": "a recognised shape lacks a field (completion, output, a message's role or content)",
    "bad field type": "a field has the wrong type (content that is neither a string nor a list of text parts, "
                      "messages not a list)",
    "non-text content": "a message's content holds a part that is not text (an image, audio), which a text model "
                        "cannot train on",
    "starts with the assistant": "the first message is an assistant reply: a reply is found by rendering the "
                                 "conversation before it, and a chat template renders no empty conversation; start "
                                 "with the user message it answers (or a system message)",
    "empty": "nothing to train on (empty completion, output, text or conversation)",
    "empty replies": "every assistant reply of the conversation is empty: the model would learn nothing but to end "
                     "its turn at once",
    "chat template mismatch": "the template refuses the conversation, or its rendering of a shorter conversation "
                              "is not a prefix of the full one",
    "prompt longer than seq_len": "no trained token within the first seq_len tokens (the prompt alone fills them)",
    "longer than seq_len": "more tokens than seq_len (drop_long=True)",
    "no trainable token": "every label is masked (a conversation without an assistant reply)",
}

# The roles a chat row may use, and the other names datasets give them (ShareGPT, FastChat, Glaive,
# LLaMA 3.1's "ipython" for tool output). Aliases are renamed before the chat template sees them.
ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant",
                "function": "tool", "function_response": "tool", "observation": "tool", "ipython": "tool"}

@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # the token, or IGNORE_INDEX; not shifted
    row: int = 0  # the row it came from, counted from 1 (for error messages)


class BadRow(Exception):
    """A row that cannot be used; `reason` is one of DROP_REASONS."""

    def __init__(self, reason: str):
        assert reason in DROP_REASONS, reason
        super().__init__(reason)
        self.reason = reason


class UnknownRole(Exception):
    """A chat message whose role is neither in ROLES nor in ROLE_ALIASES (stops the build: see the module docstring)."""

    def __init__(self, role: str, turn: int):
        super().__init__(role)
        self.role, self.turn = role, turn


@dataclass
class DataReport:
    """What became of the rows: kept, dropped by reason, and how many tokens are trained on."""

    source: str
    rows: int = 0
    seq_len: int = 0
    truncated: int = 0  # kept, cut to seq_len tokens
    dropped: dict = field(default_factory=dict)  # reason -> number of rows
    train_examples: int = 0
    eval_examples: int = 0
    eval_source: "DataReport | None" = None  # the rows of a separate eval file
    tokens: int = 0  # tokens of the kept examples (after truncation), before padding
    trainable_tokens: int = 0  # of those, the ones with a label (!= -100)

    @property
    def kept(self) -> int:
        return self.rows - sum(self.dropped.values())

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def counts(self) -> str:
        """'30 rows: 2 kept whole, 25 truncated to 128 tokens, 3 dropped (prompt longer than seq_len: 3)'"""
        n_dropped = sum(self.dropped.values())
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.dropped.items()))
        return (f"{self.rows} rows: {self.kept - self.truncated} kept whole, {self.truncated} truncated to "
                f"{self.seq_len} tokens, {n_dropped} dropped" + (f" ({reasons})" if reasons else ""))

    def reasons(self) -> str:
        """What each reason rows were dropped for means: 'empty: nothing to train on (...); ...'."""
        return "; ".join(f"{reason}: {DROP_REASONS[reason]}" for reason in sorted(self.dropped))

    def __str__(self) -> str:
        share = 100.0 * self.trainable_tokens / self.tokens if self.tokens else 0.0
        split = f"{self.train_examples} train" + (f", {self.eval_examples} eval" if self.eval_source is None else "")
        line = (f"{self.source}: {self.counts()}; {split}; {self.tokens:,} tokens, {self.trainable_tokens:,} "
                f"trainable ({share:.1f} %)")
        if self.eval_source is not None:
            line += f"; eval {self.eval_source.source}: {self.eval_source.counts()}"
        return line


def _text_field(row: dict, key: str, required: bool = True) -> str:
    value = row.get(key)
    if value is None:
        if required:
            raise BadRow("missing field")
        return ""
    if not isinstance(value, str):
        raise BadRow("bad field type")
    return value


def _text_parts(parts: list) -> str:
    """OpenAI's content parts, [{"type": "text", "text": ...}, ...], as one string: the texts joined by
    newlines (as vLLM joins them). A part of another type (an image, audio) drops the row."""
    texts = []
    for part in parts:
        if not isinstance(part, dict):
            raise BadRow("bad field type")
        if part.get("type") != "text":
            raise BadRow("non-text content")
        if not isinstance(part.get("text"), str):
            raise BadRow("bad field type")
        texts.append(part["text"])
    return "\n".join(texts)


def _offsets(tokenizer, text: str):
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise TypeError(f"{type(tokenizer).__name__} gives no character offsets; prompt masking needs a fast "
                        "(tokenizers-backed) tokenizer") from None
    return enc["input_ids"], enc["offset_mapping"]


def _chat_messages(row: dict) -> list[dict]:
    """The row's conversation as [{"role", "content"}] with roles in ROLES. Chat rows give "messages"
    with role/content; ShareGPT rows give "conversations" with from/value (role/content also
    accepted there) and may give the system prompt as a top-level "system" string."""
    sharegpt = "messages" not in row
    turns = row["conversations"] if sharegpt else row["messages"]
    if not isinstance(turns, list):
        raise BadRow("bad field type")
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    messages = []
    system = row.get("system") if sharegpt else None
    if system is not None:
        if not isinstance(system, str):
            raise BadRow("bad field type")
        if system.strip():
            messages.append({"role": "system", "content": system})
    for turn, m in enumerate(turns, start=1):
        if not isinstance(m, dict):
            raise BadRow("bad field type")
        role = m.get(role_key, m.get("role")) if sharegpt else m.get(role_key)
        content = m.get(content_key, m.get("content")) if sharegpt else m.get(content_key)
        if role is None or content is None:
            raise BadRow("missing field")
        if isinstance(content, list):  # OpenAI's content parts
            content = _text_parts(content)
        if not isinstance(role, str) or not isinstance(content, str):
            raise BadRow("bad field type")
        name = role.strip().lower()
        name = ROLE_ALIASES.get(name, name)
        if name not in ROLES:
            raise UnknownRole(role, turn)
        messages.append({"role": name, "content": content})
    if not turns:
        raise BadRow("empty")
    if messages[0]["role"] == "assistant":
        raise BadRow("starts with the assistant")
    return messages


def _encode_chat(row: dict, tokenizer) -> tuple[list[int], list[bool]]:
    messages = _chat_messages(row)
    if all(not m["content"].strip() for m in messages):
        raise BadRow("empty")
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"chat rows need a chat template, and the tokenizer {name} has none; use an instruct "
                         "model's tokenizer, or prompt/completion rows")
    render = tokenizer.apply_chat_template
    try:
        full = render(messages, tokenize=False)
    except Exception:  # noqa: BLE001  (a template that refuses the conversation: roles out of order, ...)
        raise BadRow("chat template mismatch") from None
    # Character spans of the assistant replies: what rendering message i adds after the assistant
    # header that add_generation_prompt would print. Found by rendering, so any template works
    # whose shorter conversations render as prefixes of the longer ones.
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = render(messages[:i], tokenize=False, add_generation_prompt=True)
            through = render(messages[: i + 1], tokenize=False)
        except Exception:  # noqa: BLE001  (a template that refuses a partial conversation)
            raise BadRow("chat template mismatch") from None
        if not (through.startswith(before) and full.startswith(through)):
            raise BadRow("chat template mismatch")
        spans.append((len(before), len(through)))
    ids, offsets = _offsets(tokenizer, full)
    # A token belongs to a reply when its first character does (a BPE token that straddles the
    # header/reply boundary stays masked).
    trainable = [any(s <= start < e for s, e in spans) for start, _ in offsets]
    return ids, trainable


def _encode_prompt_completion(prompt: str, completion: str, tokenizer) -> tuple[list[int], list[bool]]:
    ids, offsets = _offsets(tokenizer, prompt + completion)
    trainable = [start >= len(prompt) for start, _ in offsets]
    if tokenizer.bos_token_id is not None:
        ids, trainable = [tokenizer.bos_token_id] + ids, [False] + trainable
    if tokenizer.eos_token_id is not None:  # the model learns to stop after the completion
        ids, trainable = ids + [tokenizer.eos_token_id], trainable + [True]
    return ids, trainable


def check_row(row, train_on_prompt: bool = False) -> str:
    """What can be told of a row without a tokenizer: its shape ("chat", "prompt", "instruction" or "text"), or
    BadRow(reason) when it leaves nothing to train on (UnknownRole for a chat role no template knows)."""
    if not isinstance(row, dict):
        raise BadRow("not an object")
    if "messages" in row or "conversations" in row:
        messages = _chat_messages(row)
        if all(not m["content"].strip() for m in messages):
            raise BadRow("empty")
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        if replies and not any(reply.strip() for reply in replies):
            raise BadRow("empty replies")
        if not replies and not train_on_prompt:  # (what the encoding finds too: every label masked)
            raise BadRow("no trainable token")
        return "chat"
    if "prompt" in row or "completion" in row:
        _text_field(row, "prompt")
        if not _text_field(row, "completion").strip():
            raise BadRow("empty")
        return "prompt"
    if "instruction" in row or "output" in row:
        instruction, output = _text_field(row, "instruction"), _text_field(row, "output")
        _text_field(row, "input", required=False)
        if not output.strip() or not instruction.strip():
            raise BadRow("empty")
        return "instruction"
    if "text" in row:
        if not _text_field(row, "text").strip():
            raise BadRow("empty")
        return "text"
    raise BadRow("unknown shape")


def encode_row(row, tokenizer, train_on_prompt: bool = False) -> Example:
    """One row -> an Example (labels masked as the module docstring says). Raises BadRow(reason)."""
    shape = check_row(row, train_on_prompt)
    if shape == "chat":
        ids, trainable = _encode_chat(row, tokenizer)
    elif shape == "prompt":
        ids, trainable = _encode_prompt_completion(row["prompt"], row["completion"], tokenizer)
    elif shape == "instruction":
        instruction, output, extra = row["instruction"], row["output"], _text_field(row, "input", required=False)
        prompt = (ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=extra) if extra.strip()
                  else ALPACA_PROMPT.format(instruction=instruction))
        ids, trainable = _encode_prompt_completion(prompt, output, tokenizer)
    else:
        ids, _ = _encode_prompt_completion("", row["text"], tokenizer)
        trainable = [True] * len(ids)
    labels = [t if (keep or train_on_prompt) else IGNORE_INDEX for t, keep in zip(ids, trainable)]
    if labels:
        labels[0] = IGNORE_INDEX  # no token of this example comes before it
    return Example(list(ids), labels)


def encode_rows(rows: list, tokenizer, seq_len: int, train_on_prompt: bool = False,
                source: str = "rows", drop_long: bool = False) -> tuple[list[Example], DataReport]:
    """Encode every row; count the ones that cannot be used by reason instead of dropping them silently.

    An example longer than seq_len is cut to its first seq_len tokens, or dropped with `drop_long`
    (see "Examples longer than seq_len" in the module docstring). A chat role that is neither in
    ROLES nor an alias raises DataError naming the row.
    """
    report = DataReport(source=source, rows=len(rows), seq_len=seq_len)
    examples = []
    with running(f"encoding the rows of {source}", total=len(rows), unit="rows") as at:  # (a line if it takes long)
        for number, row in enumerate(rows, start=1):
            at.done = number - 1
            try:
                ex = encode_row(row, tokenizer, train_on_prompt)
                if all(label == IGNORE_INDEX for label in ex.labels):
                    raise BadRow("no trainable token")
                cut = len(ex.input_ids) > seq_len
                if cut and drop_long:
                    raise BadRow("longer than seq_len")
                if cut:
                    ex = Example(ex.input_ids[:seq_len], ex.labels[:seq_len])
                    if all(label == IGNORE_INDEX for label in ex.labels):
                        raise BadRow("prompt longer than seq_len")
            except BadRow as bad:
                report.drop(bad.reason)
                continue
            except UnknownRole as odd:
                accepted = ", ".join(ROLES) + "; aliases " + ", ".join(f"{a} -> {r}" for a, r in ROLE_ALIASES.items())
                raise DataError(f"{source}, row {number}: message {odd.turn} has the role {odd.role!r}, which no "
                                f"chat template knows; accepted roles: {accepted}. Rename the role in the "
                                "file") from None
            ex.row = number
            report.truncated += cut
            examples.append(ex)
            report.tokens += len(ex.input_ids)
            report.trainable_tokens += sum(label != IGNORE_INDEX for label in ex.labels)
    return examples, report
