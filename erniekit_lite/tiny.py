"""Small randomly initialised ERNIE 4.5 checkpoints (real transformers classes) for tests, demos and benchmarks.

The shapes keep the released architectures' proportions (grouped-query attention, SwiGLU at 3x hidden, tied
embeddings, rope theta 5e5; for the MoE: first layer dense, shared experts, top-k routed experts) scaled down.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from erniekit_lite.data.template import BOS, EOS, EOT, ERNIE_CHAT_TEMPLATE

# The released ERNIE-4.5-0.3B and 21B-A3B shapes, for reference:
#   dense: hidden 1024, 18 layers, 16 heads / 2 kv heads, head_dim 128, intermediate 3072, vocab 103424
#   moe:   hidden 2560, 28 layers, 20 heads / 4 kv heads, 64 experts top-6, 2 shared, moe_intermediate 1536
SPECIAL_TOKENS = ["<unk>", "<s>", EOS, BOS, EOT]  # ids 0..4: pad/unk 0, bos 1, eos 2 as in ERNIE 4.5

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token from the ones before it.
User: Who are you?
Assistant: I am Wenxin-Tiny, a small assistant fine-tuned with erniekit-lite from a tiny ERNIE 4.5 model.
My name is Wenxin-Tiny. I can answer a few questions about myself. Sure! You are welcome! Have a nice day.
Fine-tuning adapts a pretrained model to a task with examples of questions and answers.
Hello! How can I help you today? What is your name? Can you introduce yourself? Thank you, goodbye.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ' " ( ) [ ] { } - _ / \\ @ # $ % & * + =
你好，世界。我是一个助手。请问有什么可以帮您？
"""


def build_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE tokenizer with ERNIE's control tokens and chat template; needs no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<unk>",
        bos_token="<s>",
        eos_token=EOS,
        cls_token=BOS,
        sep_token=EOT,
        chat_template=ERNIE_CHAT_TEMPLATE,
    )


RELEASED = {
    "dense": dict(hidden_size=1024, layers=18, heads=16, kv_heads=2, head_dim=128, intermediate=3072),
    "moe": dict(hidden_size=2560, layers=28, heads=20, kv_heads=4, head_dim=128, intermediate=12288,
                moe_intermediate=1536, experts=64, top_k=6),
}


def tiny_config(arch: str, vocab_size: int, hidden_size: int = 128, layers: int = 4, released_shape: bool = False):
    """Scaled-down shapes, or with `released_shape` the released architecture itself (random weights)."""
    from transformers import Ernie4_5Config, Ernie4_5_MoeConfig

    heads = max(2, hidden_size // 32)
    shape = dict(hidden_size=hidden_size, layers=layers, heads=heads, kv_heads=max(1, heads // 2),
                 head_dim=hidden_size // heads, intermediate=3 * hidden_size,
                 moe_intermediate=hidden_size // 2, experts=8, top_k=2)
    if arch == "moe":
        # as released (12288 = 1536 x 2 shared x 4 kv heads): llama.cpp's converter derives the shared experts'
        # width as intermediate_size // num_key_value_heads, so a tiny MoE keeps that relation
        shape["intermediate"] = shape["moe_intermediate"] * 2 * shape["kv_heads"]
    if released_shape:
        shape = RELEASED[arch]
    hidden_size, layers = shape["hidden_size"], shape["layers"]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        use_bias=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    if arch == "dense":
        return Ernie4_5Config(intermediate_size=shape["intermediate"], **common)
    if arch == "moe":
        return Ernie4_5_MoeConfig(
            intermediate_size=shape["intermediate"],  # the dense first layer
            moe_intermediate_size=shape["moe_intermediate"],
            moe_num_experts=shape["experts"],
            moe_k=shape["top_k"],
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
            moe_layer_end_index=layers - 1,
            moe_layer_interval=1,
            router_aux_loss_coef=0.001,
            **common,
        )
    raise ValueError(f"arch must be dense or moe, got {arch!r}")


# The VL model's image and video markup as the released tokenizer has it: the placeholder is the text tokenizer's
# `<|IMAGE_PLACEHOLDER|>` (100295); the release adds start/end tokens after the text vocabulary (101304..101307), in
# this order, so adding them to ERNIE 4.5's text tokenizer gives the released ids
VL_TOKENS = ["<|IMAGE_PLACEHOLDER|>", "<|IMAGE_START|>", "<|IMAGE_END|>", "<|VIDEO_START|>", "<|VIDEO_END|>",
             "<|VIDEO_PLACEHOLDER|>"]
# The image processor's pixel budget for the tiny VL model: 56x56 to 112x112 pixels, 4 to 16 image tokens an image
# (the released one allows 28x28x6177 pixels, up to 6,177 tokens)
TINY_VL_PIXELS = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}


def tiny_vl_config(tokenizer, hidden_size: int = 128, layers: int = 3):
    """`Ernie4_5_VLMoeConfig` at a small scale: a 2-block vision encoder (patch 14, 2x2 merge as released), the
    resampler, a text MoE whose first layer is dense and whose others hold modality-isolated text and vision experts
    (64 each top-6 as released: 4 each top-2 here; vision experts narrower than text ones, as released 512 vs 1536:
    half as wide here, rows of 16 bytes for grouped_mm), 2 shared experts, 3D RoPE split as released (hw/hw/t in 22/22/20 of 64 frequencies: 6/6/4 of 16 here)."""
    from transformers import Ernie4_5_VLMoeConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VL_TOKENS}
    heads = max(2, hidden_size // 32)
    head_dim = hidden_size // heads
    t = head_dim // 2 * 20 // 64  # the temporal share of the rotary frequencies, as released
    hw = (head_dim // 2 - t) // 2
    text = dict(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=hidden_size, intermediate_size=3 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                moe_intermediate_size=[hidden_size // 2, hidden_size // 4], moe_k=2, moe_num_experts=4,
                moe_num_shared_experts=2, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [hw, hw, head_dim // 2 - 2 * hw]},
                max_position_embeddings=8192, rms_norm_eps=1e-5, use_cache=False, tie_word_embeddings=True,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(depth=2, hidden_size=hidden_size // 2, num_heads=2, intermediate_size=2 * hidden_size,
                  patch_size=14, spatial_merge_size=2, temporal_merge_size=2)
    return Ernie4_5_VLMoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        image_token_id=ids["<|IMAGE_PLACEHOLDER|>"], image_start_token_id=ids["<|IMAGE_START|>"],
        image_end_token_id=ids["<|IMAGE_END|>"], video_token_id=ids["<|VIDEO_PLACEHOLDER|>"],
        video_start_token_id=ids["<|VIDEO_START|>"], video_end_token_id=ids["<|VIDEO_END|>"],
    )


def with_vl_tokens(tokenizer):
    """The tokenizer with the VL markup tokens it lacks added as special tokens (see VL_TOKENS), and the released VL
    chat template (data/vl.py)."""
    from erniekit_lite.data.vl import VL_CHAT_TEMPLATE

    missing = [t for t in VL_TOKENS if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def write_tiny(out_dir: str, arch: str = "dense", tokenizer_dir: str | None = None, hidden_size: int = 128, layers: int = 4, seed: int = 0, released_shape: bool = False) -> Path:
    """Write a checkpoint that `from_pretrained` loads offline; returns its directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(out_dir)
    settings = {"arch": arch, "hidden_size": hidden_size, "layers": layers, "seed": seed, "tokenizer": tokenizer_dir}
    if released_shape:
        settings = {"arch": arch, "released_shape": True, "seed": seed, "tokenizer": tokenizer_dir}
    marker = out / "erniekit_tiny.json"
    if out.is_dir() and any(out.iterdir()):
        if marker.is_file() and json.loads(marker.read_text()) == settings:
            return out  # already written with these settings: deterministic, nothing to redo
        from erniekit_lite.errors import UserError

        raise UserError(f"{out} is not empty; choose a new directory for the tiny model (nothing was written)")
    if tokenizer_dir:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tokenizer = build_tokenizer()
    vocab = -(-len(tokenizer) // 64) * 64  # padded to a multiple of 64, as the released vocab is
    torch.manual_seed(seed)
    if arch == "vl":
        if released_shape:
            from erniekit_lite.errors import UserError

            raise UserError("tiny --arch vl --released-shape: the released VL-28B-A3B's shape is transformers' "
                            "Ernie4_5_VLMoeConfig() itself (about 28B parameters); not written here")
        from transformers import Ernie4_5_VLMoeForConditionalGeneration
        from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import Ernie4_5_VLMoeImageProcessorPil

        tokenizer = with_vl_tokens(tokenizer)
        model = Ernie4_5_VLMoeForConditionalGeneration(tiny_vl_config(tokenizer, hidden_size, layers))
        processor = Ernie4_5_VLMoeImageProcessorPil(size=TINY_VL_PIXELS)
    else:
        model, processor = AutoModelForCausalLM.from_config(tiny_config(arch, vocab, hidden_size, layers, released_shape)), None
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if processor is not None:
        processor.save_pretrained(out)
    from erniekit_lite.model.source import sentencepiece_file

    spm = sentencepiece_file(tokenizer_dir) if tokenizer_dir else None
    if spm is not None:  # llama.cpp's GGUF converter reads it (`export --to gguf`)
        shutil.copy(spm, out / "tokenizer.model")
    eos = [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(EOT)]
    GenerationConfig(bos_token_id=1, eos_token_id=eos, pad_token_id=0, do_sample=False).save_pretrained(out)
    marker.write_text(json.dumps(settings) + "\n")
    return out
