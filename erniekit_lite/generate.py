"""Greedy or sampled answers through the same template pieces training used, so inference matches training."""

from __future__ import annotations

from dataclasses import dataclass, field

from erniekit_lite.data.formats import Turn
from erniekit_lite.data.template import EOS, EOT, template_for
from erniekit_lite.data.tokenize import Tokenizer


@dataclass
class Prompt:
    user: str
    system: str | None = None
    history: list[Turn] = field(default_factory=list)


def answer(model, tokenizer, prompt: str, system: str | None = None, history: list[Turn] | None = None, max_new_tokens: int = 64, **generate_kwargs) -> str:
    return answers(model, tokenizer, [Prompt(prompt, system, history or [])], max_new_tokens=max_new_tokens, **generate_kwargs)[0]


def answers(model, tokenizer, prompts: list[Prompt], batch_size: int = 1, max_new_tokens: int = 64, progress=None, **generate_kwargs) -> list[str]:
    """One answer per prompt, in order, generated `batch_size` prompts at a time (left-padded); greedy by default.

    Prompts are batched in order of length, so a batch holds little padding; `progress` (a tqdm bar) is advanced
    by each batch's size. Padding needs an attention that reads the mask: not the packed ones, which register no mask.
    """
    import torch

    from erniekit_lite.model.attention import PACKED

    if batch_size > 1 and model.config._attn_implementation in PACKED:
        raise ValueError(f"{model.config._attn_implementation} ignores padding; call model.set_attn_implementation('sdpa') before batched generation")
    tok = Tokenizer(tokenizer, template_for(tokenizer))
    ids = [_prompt_ids(tok, p) for p in prompts]
    stop = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    device = next(model.parameters()).device
    generate_kwargs.setdefault("do_sample", False)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    texts: list[str] = [""] * len(ids)
    was_training = model.training
    model.eval()
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = max(len(ids[i]) for i in batch)
        # Left padding: every prompt ends where generation starts; the mask keeps the padding out of attention
        input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in batch], device=device)
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                eos_token_id=stop,
                pad_token_id=pad,
                use_cache=True,
                **generate_kwargs,
            )
        for i, row in zip(batch, out[:, width:].tolist()):
            # A row that stopped early is filled with padding up to the batch's longest answer; cut at its stop
            end = next((k for k, t in enumerate(row) if t in stop), len(row))
            texts[i] = tokenizer.decode(row[:end], skip_special_tokens=True)
        if progress is not None:
            progress.update(len(batch))
    model.train(was_training)
    return texts


def image_answer(model, tokenizer, processor, user: list, system: str | None = None, history: list | None = None,
                 max_new_tokens: int = 64, **generate_kwargs) -> str:
    """ERNIE-4.5-VL: the answer to a user turn of text and images (`user`: str and `data.vl.Image` parts, in order),
    prompted with the training sample's pieces (data/vl.py); `history`: earlier (user Message, answer Message) pairs.
    The model computes its own 3D positions from the token types and image grids, as training's are (tests/test_vl.py)."""
    import numpy as np
    import torch

    from erniekit_lite.data.vl import Message, VLTemplate

    prompt = VLTemplate(tokenizer, processor).prompt(system, history or [], Message("user", user), "chat")
    device = next(model.parameters()).device
    inputs = {"input_ids": torch.tensor([prompt.input_ids], device=device),
              "attention_mask": torch.ones((1, len(prompt)), dtype=torch.long, device=device),
              "mm_token_type_ids": torch.tensor([prompt.image_types], device=device),
              "moe_mm_token_type_ids": torch.tensor([prompt.routing_types], device=device)}
    if prompt.grids:
        inputs["pixel_values"] = torch.from_numpy(np.concatenate(prompt.pixel_values)).to(device, model.dtype)
        inputs["image_grid_thw"] = torch.tensor(prompt.grids, device=device)
    stop = stop_ids(model, tokenizer)
    generate_kwargs.setdefault("do_sample", False)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=stop, use_cache=True,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0], **generate_kwargs)
    model.train(was_training)
    row = out[0, len(prompt):].tolist()
    end = next((k for k, t in enumerate(row) if t in stop), len(row))
    return tokenizer.decode(row[:end], skip_special_tokens=True)


def greedy_ids(model, tokenizer, text: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """The prompt ids training builds for one user turn, and the greedy answer's ids before the first stop token:
    what other engines (llama.cpp, vLLM) are compared with, token for token."""
    import torch

    ids = _prompt_ids(Tokenizer(tokenizer, template_for(tokenizer)), Prompt(text))
    stop = stop_ids(model, tokenizer)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids], device=model.device), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop, pad_token_id=tokenizer.pad_token_id or 0)[0, len(ids):].tolist()
    return ids, out[:next((k for k, t in enumerate(out) if t in stop), len(out))]


def stop_ids(model, tokenizer) -> list[int]:
    """ERNIE's end tokens, plus whatever the checkpoint's generation config ends on (`<|im_end|>` for a Thinking model)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    candidates = [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(EOT), *configured]
    return sorted({i for i in candidates if isinstance(i, int) and 0 <= i != tokenizer.unk_token_id})


def _prompt_ids(tok: Tokenizer, prompt: Prompt) -> list[int]:
    pieces = tok.template.generation_prompt(prompt.system, prompt.history, prompt.user)
    encoded = iter(tok.encode_pieces(pieces))
    return [t for p in pieces for t in (next(encoded) if p.text is not None else p.ids)]
