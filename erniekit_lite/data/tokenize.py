"""Conversations -> token ids and labels (-100 where no loss), with overlong handling.

Worked example (real ERNIE 4.5 tokenizer), system "S", one turn "hi" -> "Hello":

    pieces   <|begin_of_sentence|> | S\\nUser: hi\\nAssistant:  | Hello | <|end_of_sentence|>
    ids      100273                | ... 92267 93963 93919     | 16276 | 100272
    labels   -100                  | -100 ...                  | 16276 | 2   (</s>, the eos generation stops on)

Labels are aligned with `input_ids` (the model shifts them). Every sample starts with an untrained token, so
samples concatenated in a packed row never train one sample's last token to predict the next one's first.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from erniekit_lite.data.formats import Conversation
from erniekit_lite.data.template import ErnieTemplate, ModelTemplate, Piece

IGNORE = -100
_BATCH = 2048  # texts per tokenizer call; batching is what makes the fast tokenizer fast


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class TokenStats:
    kept: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_untrained: int = 0
    lengths: list[int] = field(default_factory=list)  # of kept samples, after truncation
    trained_tokens: int = 0

    def add(self, later: TokenStats) -> None:
        """Fold in the statistics of the conversations that follow (so chunks add up to one whole call)."""
        self.kept += later.kept
        self.truncated += later.truncated
        self.dropped_overlong += later.dropped_overlong
        self.dropped_untrained += later.dropped_untrained
        self.lengths += later.lengths
        self.trained_tokens += later.trained_tokens


class Tokenizer:
    """Turns conversations into samples for one tokenizer and template."""

    def __init__(self, tokenizer, template: ErnieTemplate | ModelTemplate):
        self.tokenizer = tokenizer
        self.template = template

    def encode_pieces(self, pieces: list[Piece]) -> list[list[int]]:
        """Token ids of the text pieces, in order: message text as text, template markup (`special`) with its control
        tokens parsed."""
        texts = [p for p in pieces if p.text is not None]
        out: list[list[int] | None] = [None] * len(texts)
        for special in (False, True):
            where = [i for i, p in enumerate(texts) if p.special == special]
            for i, ids in zip(where, self.encode([texts[i].text for i in where], special)):
                out[i] = ids
        return out

    def encode(self, texts: list[str], special: bool = False) -> list[list[int]]:
        """Token ids of each text; control-token spellings are control tokens only when `special`."""
        if not texts:
            return []
        backend = _direct_backend(self.tokenizer)
        if backend is None:
            out: list[list[int]] = []
            for i in range(0, len(texts), _BATCH):
                chunk = texts[i : i + _BATCH]
                out += self.tokenizer(chunk, add_special_tokens=False, split_special_tokens=not special)["input_ids"]
            return out
        # What transformers' __call__ does with these arguments, minus a BatchEncoding per text (a tenth of the
        # time); tests/test_tokenize.py checks the ids are the same
        before = backend.encode_special_tokens
        backend.encode_special_tokens = not special
        try:
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast (tokenizers >= 0.21): no offsets
            return [e.ids for i in range(0, len(texts), _BATCH) for e in encode(texts[i : i + _BATCH], add_special_tokens=False)]
        finally:
            backend.encode_special_tokens = before

    def __call__(self, convs: list[Conversation], max_length: int, overlong: str = "truncate") -> tuple[list[Sample | None], TokenStats]:
        """One entry per conversation: a Sample, or None when it was dropped (counted in the stats)."""
        if overlong not in ("truncate", "drop"):
            raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        per_conv = [self.template.pieces(c) for c in convs]
        encoded = iter(self.encode_pieces([p for turns in per_conv for turn in turns for p in turn]))
        stats = TokenStats()
        samples: list[Sample | None] = []
        for conv, turns in zip(convs, per_conv):
            ids: list[int] = []
            labels: list[int] = []
            turn_ends = []
            for turn in turns:
                _extend(ids, labels, turn, encoded)
                turn_ends.append(len(ids))
            sample = Sample(ids, labels) if len(ids) <= max_length else self._fit(conv, ids, labels, turn_ends, max_length, overlong)
            if sample is None:
                stats.dropped_overlong += 1
            elif (ignored := sample.labels.count(IGNORE)) == len(sample.labels):
                stats.dropped_untrained += 1
                sample = None
            else:
                stats.kept += 1
                stats.truncated += sample.truncated
                stats.lengths.append(len(sample))
                stats.trained_tokens += len(sample.labels) - ignored
            samples.append(sample)
        return samples, stats

    def _fit(
        self, conv: Conversation, ids: list[int], labels: list[int], turn_ends: list[int], max_length: int, overlong: str
    ) -> Sample | None:
        """An overlong conversation (`ids`, `labels`, with turn i ending at `turn_ends[i]`) cut to max_length, or None."""
        if overlong == "drop":
            return None
        # Drop the oldest turns first; the turn that becomes first carries BOS and the system line again. (A sample
        # whose template rewrites history is one turn of pieces: its history goes at once)
        for start in range(1, len(turn_ends)):
            first_ids, first_labels, _ = self._as_first_turn(conv, start)
            tail = turn_ends[start]
            if len(first_ids) + len(ids) - tail <= max_length:
                return Sample(first_ids + ids[tail:], first_labels + labels[tail:], truncated=True)
        # Only the last turn is left and still too long: cut its response (the end-of-turn token goes with it)
        ids, labels, prompt_length = self._as_first_turn(conv, len(conv.turns) - 1)
        if prompt_length >= max_length:
            return None
        return Sample(ids[:max_length], labels[:max_length], truncated=True)

    def _as_first_turn(self, conv: Conversation, index: int) -> tuple[list[int], list[int], int]:
        """Tokens of turn `index` rendered as the first turn, and the length of its prompt part."""
        pieces = self.template.pieces(replace(conv, turns=conv.turns[index : index + 1]))[0]
        encoded = iter(self.encode_pieces(pieces))
        ids: list[int] = []
        labels: list[int] = []
        prompt_length = None
        for piece in pieces:
            if piece.response and prompt_length is None:
                prompt_length = len(ids)
            piece_ids, piece_labels = _assemble([piece], encoded)
            ids += piece_ids
            labels += piece_labels
        return ids, labels, prompt_length if prompt_length is not None else len(ids)


def _assemble(pieces: list[Piece], encoded) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    labels: list[int] = []
    _extend(ids, labels, pieces, encoded)
    return ids, labels


def _extend(ids: list[int], labels: list[int], pieces: list[Piece], encoded) -> None:
    """Append the pieces' tokens and labels; text pieces take the next entry of `encoded`."""
    for piece in pieces:
        piece_ids = next(encoded) if piece.text is not None else piece.ids
        ids += piece_ids
        if not piece.trained:
            labels += [IGNORE] * len(piece_ids)
        else:
            labels += piece_ids if piece.label_ids is None else piece.label_ids


def _direct_backend(tokenizer):
    """The Rust tokenizer behind a transformers fast tokenizer, when calling it directly is what `__call__` does:
    a plain `TokenizersBackend` (no subclass with its own encoding) with no truncation or padding set."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: take the ordinary path
        return None
    kind = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or hasattr(tokenizer, "_switch_to_input_mode") or any(
        getattr(kind, name) is not getattr(TokenizersBackend, name) for name in ("__call__", "_encode_plus")
    ):
        return None
    backend = tokenizer.backend_tokenizer
    return backend if backend.truncation is None and backend.padding is None else None

