"""The ERNIE 4.5 chat format as pieces to tokenize separately, each marked trained or not.

Released template (ERNIE-4.5-0.3B-PT and 21B-A3B-PT):

    <|begin_of_sentence|>{system}\\n            (system line only when there is one)
    User: {q1}\\nAssistant: {a1}<|end_of_sentence|>
    User: {q2}\\nAssistant: {a2}<|end_of_sentence|>

Each turn is cut into a prompt piece ending in the generation prompt `Assistant: ` and a response piece, and
the two are tokenized separately. `Assistant: ` then ends in the token `▁`, exactly what inference feeds the
model before it generates; tokenizing the whole string would fuse the space into the response (`▁Hello`) and
train on a sequence the model never sees. As in ERNIEKit, the label of each `<|end_of_sentence|>` is `</s>`,
the eos of the released `generation_config.json`, so a tuned model stops where generation expects.

User text is tokenized with special-token parsing off: a user who types `<|end_of_sentence|>` gets those
characters, never the control token. Control tokens come only from the template, as ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from erniekit_lite.data.formats import Conversation, Turn

ERNIE_CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}\n"
    "    {%- set add_generation_prompt = true -%}\n"
    "{%- endif -%}\n"
    "{%- if not cls_token is defined -%}\n"
    '    {%- set cls_token = "<|begin_of_sentence|>" -%}\n'
    "{%- endif -%}\n"
    "{%- if not sep_token is defined -%}\n"
    '    {%- set sep_token = "<|end_of_sentence|>" -%}\n'
    "{%- endif -%}\n"
    "{{- cls_token -}}\n"
    "{%- for message in messages -%}\n"
    '    {%- if message["role"] == "user" -%}\n'
    '        {{- "User: " + message["content"] + "\n" -}}\n'
    '    {%- elif message["role"] == "assistant" -%}\n'
    '        {{- "Assistant: " + message["content"] + sep_token -}}\n'
    '    {%- elif message["role"] == "system" -%}\n'
    '        {{- message["content"] + "\n" -}}\n'
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    '    {{- "Assistant: " -}}\n'
    "{%- endif -%}"
)
BOS = "<|begin_of_sentence|>"
EOT = "<|end_of_sentence|>"
EOS = "</s>"


@dataclass
class Piece:
    """A run of tokens: plain text (tokenized without special-token parsing) or fixed ids."""

    text: str | None = None
    ids: tuple[int, ...] = ()
    trained: bool = False
    label_ids: tuple[int, ...] | None = None  # labels for `ids` when they differ from the ids (eot -> eos)
    response: bool = False  # part of the assistant's answer (trained unless the turn is masked)


class ErnieTemplate:
    name = "ernie4.5"

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab()
        missing = [t for t in (BOS, EOT, EOS) if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer lacks the ERNIE 4.5 control tokens {missing}")
        self.bos_id, self.eot_id, self.eos_id = vocab[BOS], vocab[EOT], vocab[EOS]

    def prompt_text(self, system: str | None, turn_index: int, user: str) -> str:
        head = f"{system}\n" if (turn_index == 0 and system) else ""
        return f"{head}User: {user}\nAssistant: "

    def pieces(self, conv: Conversation) -> list[list[Piece]]:
        """One list of pieces per turn: [prompt, response, end-of-turn]; the first turn starts with BOS."""
        turns = []
        for i, turn in enumerate(conv.turns):
            lead = [Piece(ids=(self.bos_id,))] if i == 0 else []
            turns.append(
                lead
                + [
                    Piece(text=self.prompt_text(conv.system, i, turn.user)),
                    Piece(text=turn.assistant, trained=turn.train, response=True),
                    Piece(ids=(self.eot_id,), trained=turn.train, label_ids=(self.eos_id,), response=True),
                ]
            )
        return turns

    def generation_prompt(self, system: str | None, history: list[Turn], user: str) -> list[Piece]:
        """What inference feeds the model: the same pieces as training, ending in `Assistant: `."""
        conv = Conversation(history + [Turn(user, "")], system)
        *done, last = self.pieces(conv)
        flat = [p for turn in done for p in turn]
        return flat + last[:-2]


class ModelTemplate:
    """A chat template shipped with the model that is not ERNIE's: turns are cut by rendering growing prefixes.

    Control tokens come from the rendered text here, so special-token parsing stays on for every piece.
    """

    name = "model"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def pieces(self, conv: Conversation) -> list[list[Piece]]:
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        done, turns = "", []
        for turn in conv.turns:
            messages.append({"role": "user", "content": turn.user})
            prompt = self._render(messages, True)
            messages.append({"role": "assistant", "content": turn.assistant})
            full = self._render(messages, False)
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise ValueError("the model's chat template does not render conversations as growing prefixes")
            turns.append([Piece(text=prompt[len(done):]), Piece(text=full[len(prompt):], trained=turn.train, response=True)])
            done = full
        return turns

    def generation_prompt(self, system: str | None, history: list[Turn], user: str) -> list[Piece]:
        messages = [{"role": "system", "content": system}] if system else []
        for t in history:
            messages += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant}]
        messages.append({"role": "user", "content": user})
        return [Piece(text=self._render(messages, True))]


def template_for(tokenizer) -> ErnieTemplate | ModelTemplate:
    """ERNIE's template unless the tokenizer ships a different one (decided by rendering, not by string compare)."""
    own = getattr(tokenizer, "chat_template", None)
    try:
        ernie = ErnieTemplate(tokenizer)
    except ValueError:
        if not own:
            raise
        return ModelTemplate(tokenizer)
    if not own:
        return ernie
    probe = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    expected = f"{BOS}S\nUser: Q1\nAssistant: A1{EOT}User: Q2\nAssistant: "
    for messages, want in ((probe, expected), (probe[1:], expected.replace(f"{BOS}S\n", BOS))):
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:
            continue  # e.g. a template that rejects system messages: probe again without one
        return ernie if rendered == want else ModelTemplate(tokenizer)
    return ernie  # the template cannot be rendered at all (e.g. no jinja2); the control tokens are ERNIE's
