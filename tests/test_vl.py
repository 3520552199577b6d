"""ERNIE-4.5-VL (issue 64): the tiny VL model, image-text samples rendered as the released template renders them, the
model's 3D positions, and packed rows that score each sample as it scores alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from erniekit_lite.data import vl, vl_rows
from erniekit_lite.errors import UserError

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> Path:
    """Solid-colour images of three sizes (4, 6 and 8 image tokens under the tiny model's pixel budget)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    for name, size, colour in [("red", (56, 56), (255, 0, 0)), ("blue", (90, 60), (0, 0, 255)), ("green", (120, 70), (0, 255, 0))]:
        Image.new("RGB", size, colour).save(folder / f"{name}.png")
    return folder


RECORDS = [
    {"messages": [{"role": "user", "content": "<image>What colour is this?"}, {"role": "assistant", "content": "Red."}],
     "images": ["red.png"]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": "blue.png"},
                                               {"type": "text", "text": " and "}, {"type": "image", "image": "green.png"}]},
                  {"role": "assistant", "content": "Blue and green."}]},
    {"messages": [{"role": "user", "content": "No image here."}, {"role": "assistant", "content": "Fine."}]},
]


def template_of(model_dir):
    from transformers import AutoTokenizer
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import Ernie4_5_VLMoeImageProcessorPil

    return vl.VLTemplate(AutoTokenizer.from_pretrained(model_dir), Ernie4_5_VLMoeImageProcessorPil.from_pretrained(model_dir))


def samples_of(template, folder, records=RECORDS):
    return [s for i, r in enumerate(records) for s in template.samples(vl.messages_of(r, folder, f"data.jsonl:{i + 1}"), f"data.jsonl:{i + 1}")]


def test_the_template_is_transformers_copy_of_the_released_one_with_its_two_faults_repaired():
    """The fixture holds the conversion script's source lines verbatim; repairing the re-indented line breaks inside
    its quoted strings and the space in `<|end_of_sentence |>` gives the project's template, character for character."""
    text = (FIXTURES / "ernie45_vl_chat_template.py.txt").read_text()
    copied = ast.literal_eval(text[text.index('"""'):].strip())
    repaired = re.sub(r"'[^'\n]*(?:\n[^']*)?'", lambda m: re.sub(r"\n +", "\n", m.group()), copied)
    assert repaired.replace("<|end_of_sentence |>", "<|end_of_sentence|>") == vl.VL_CHAT_TEMPLATE


def test_samples_are_the_template_rendering_tokenized_whole_with_each_image_expanded(ernie_tokenizer_dir, images, tmp_path):
    """With the real ERNIE tokenizer (its VL tokens at the released ids 100295 and 101304-5): each sample's ids equal
    the chat template's rendering (prompt with the generation prompt, then the answer and `<|end_of_sentence|>`)
    tokenized whole, each `<|IMAGE_PLACEHOLDER|>` repeated once per image token; only the answer and the end token
    are labelled, the end token as `</s>`."""
    from transformers import AutoTokenizer
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import Ernie4_5_VLMoeImageProcessorPil

    from erniekit_lite.tiny import TINY_VL_PIXELS, with_vl_tokens

    tokenizer = with_vl_tokens(AutoTokenizer.from_pretrained(ernie_tokenizer_dir))
    assert tokenizer.convert_tokens_to_ids([vl.IMAGE, vl.IMAGE_START, vl.IMAGE_END]) == [100295, 101304, 101305]
    template = vl.VLTemplate(tokenizer, Ernie4_5_VLMoeImageProcessorPil(size=TINY_VL_PIXELS))
    samples = samples_of(template, images)
    assert [s.grids for s in samples] == [[(1, 4, 4)], [(1, 4, 6), (1, 4, 8)], []]
    for record, sample in zip(RECORDS, samples):
        messages = [{"role": m.role, "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in m.parts]}
                    for m in vl.messages_of(record, images, "x")]
        answer = messages[-1]["content"][0]["text"]
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        assert prompt.endswith("\nAssistant: <think>\n\n</think>\n\n")
        head, *rest = (prompt + answer + vl.EOT).split(vl.IMAGE)
        whole = head + "".join(vl.IMAGE * (t * h * w // 4) + tail for (t, h, w), tail in zip(sample.grids, rest))
        assert sample.input_ids == tokenizer(whole, add_special_tokens=False)["input_ids"]
        trained = [t for t, label in zip(sample.input_ids, sample.labels) if label != -100]
        assert tokenizer.decode(trained) == answer + vl.EOT
        assert sample.labels[-1] == tokenizer.convert_tokens_to_ids(vl.EOS)
    # what a user typed stays text: a control token's spelling in a question is not the token
    typed = {"messages": [{"role": "user", "content": "say <|IMAGE_START|>"}, {"role": "assistant", "content": "ok"}]}
    (sample,) = samples_of(template, images, [typed])
    assert 101304 not in sample.input_ids


def test_positions_are_the_models_own_rope_index(tiny_vl_dir, images):
    from transformers import Ernie4_5_VLMoeForConditionalGeneration

    model = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(tiny_vl_dir)
    for sample in samples_of(template_of(tiny_vl_dir), images):
        if sample.grids:
            expected, _ = model.model.get_rope_index(torch.tensor([sample.input_ids]), torch.tensor([sample.image_types]),
                                                     torch.tensor(sample.grids))
            assert torch.equal(expected[:, 0], torch.from_numpy(sample.positions))
        else:
            assert (sample.positions == np.arange(len(sample))).all()
    # after an image the text restarts at its start + max(rows, columns), not its token count: 2x3 tokens -> +3
    assert vl.rope_positions([0, 1, 1, 1, 1, 1, 1, 0], [(1, 4, 6)], 2).tolist() == [
        [0, 1, 1, 1, 1, 1, 1, 4], [0, 1, 1, 1, 2, 2, 2, 4], [0, 1, 2, 3, 1, 2, 3, 4]]


def test_a_packed_row_scores_each_sample_as_it_scores_alone(tiny_vl_dir, images):
    """fp32: the logits of three samples (one image, two images, none) packed into one padding-free row, images
    encoded apart from the packed attention's arguments, equal each sample's own forward within 1e-5."""
    from transformers import Ernie4_5_VLMoeForConditionalGeneration

    from erniekit_lite.model.attention import NAME

    model = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(tiny_vl_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    samples = samples_of(template_of(tiny_vl_dir), images)

    def alone(sample):
        inputs = dict(input_ids=torch.tensor([sample.input_ids]), position_ids=torch.from_numpy(sample.positions)[:, None],
                      moe_mm_token_type_ids=torch.tensor([sample.routing_types]))
        if sample.grids:
            pixels = torch.from_numpy(np.concatenate(sample.pixel_values))
            inputs["mm_encoder_outputs"] = {"image": model.model.get_image_features(pixels, torch.tensor(sample.grids), return_dict=True)}
        return model(**inputs).logits[0]

    with torch.no_grad():
        expected = torch.cat([alone(s) for s in samples])
        model.set_attn_implementation(NAME)
        batch = vl_rows.VLPackedCollator(256)([vl_rows.VLRow(samples)])
        assert batch["position_ids"].shape == (3, 1, sum(map(len, samples))) and batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6], [1, 4, 8]]
        features = model.model.get_image_features(batch.pop("pixel_values"), batch.pop("image_grid_thw"), return_dict=True)
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "moe_mm_token_type_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                        "max_length_q", "max_length_k")}
        packed = model(**inputs, mm_encoder_outputs={"image": features}).logits[0]
    assert (packed - expected).abs().max().item() <= 1e-5


def test_bad_image_records_are_one_line_naming_the_record_and_file(tiny_vl_dir, images):
    template = template_of(tiny_vl_dir)
    (images / "broken.png").write_text("not an image")
    cases = [
        ({"messages": RECORDS[0]["messages"], "images": ["missing.png"]}, f"data.jsonl:1: image {images / 'missing.png'}: no such file"),
        ({"messages": RECORDS[0]["messages"], "images": ["broken.png"]}, f"data.jsonl:1: image {images / 'broken.png'}: not a readable image"),
        ({"messages": RECORDS[0]["messages"], "images": []}, "data.jsonl:1: 1 <image> placeholders and 0 images"),
        ({"messages": RECORDS[0]["messages"], "images": ["red.png", "red.png"]}, "data.jsonl:1: 1 <image> placeholders and 2 images"),
        ({"messages": [RECORDS[0]["messages"][0]], "images": ["red.png"]}, "data.jsonl:1: messages: user and assistant turns in turn"),
    ]
    for record, said in cases:
        with pytest.raises(UserError) as error:
            samples_of(template, images, [record])
        assert str(error.value).startswith(said) and "\n" not in str(error.value), str(error.value)


def test_lora_adapts_text_and_vision_experts_and_the_split_path_computes_peft_s(tiny_vl_dir, images):
    """Default LoRA targets on the VL model: adapters on the text layers, the text and the vision routed experts of
    every MoE layer (none on the vision encoder); `lora.vision` adds the encoder and resampler. The project's
    per-expert path (`expert_compute: split`) gives peft's own (`merged`) logits and adapter gradients on a packed row
    with images (fp32: 1e-5 and 1e-6)."""
    import copy

    from transformers import Ernie4_5_VLMoeForConditionalGeneration

    from erniekit_lite.model.attention import NAME
    from erniekit_lite.model.expert_lora import set_expert_compute
    from erniekit_lite.model.lora import apply_lora, trainable_groups
    from erniekit_lite.recipe import LoraSection

    def load():
        return Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(tiny_vl_dir, dtype=torch.float32, attn_implementation=NAME)

    torch.manual_seed(0)
    model = apply_lora(load(), LoraSection(r=4, alpha=8))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    for kind in ("text_moe", "vision_moe"):
        assert {int(n.split(".layers.")[1].split(".")[0]) for n in trained if f".mlp.{kind}.experts." in n} == {1, 2}
    assert not any("vision_tower" in n or "resampler_model" in n for n in trained)
    groups = trainable_groups(apply_lora(load(), LoraSection(r=4, alpha=8, vision=True)))
    assert groups["vision encoder"] > 0 and groups["routed experts"] == trainable_groups(model)["routed experts"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # peft starts B at zero, which would hide half the backward
    batch = vl_rows.VLPackedCollator(256)([vl_rows.VLRow(samples_of(template_of(tiny_vl_dir), images)[:2])])

    def run(mode):
        copied = copy.deepcopy(model)
        assert set_expert_compute(copied, mode) == 4  # 2 MoE layers x (text, vision)
        features = copied.get_base_model().model.get_image_features(batch["pixel_values"], batch["image_grid_thw"], return_dict=True)
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "moe_mm_token_type_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                        "max_length_q", "max_length_k")}
        logits = copied(**inputs, mm_encoder_outputs={"image": features}).logits
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad for n, p in copied.named_parameters() if p.grad is not None}

    (split, split_grads), (merged, merged_grads) = run("split"), run("merged")
    assert (split - merged).abs().max().item() <= 1e-5
    assert split_grads.keys() == merged_grads.keys() and len(split_grads) == len(trained)
    assert max((split_grads[k] - merged_grads[k]).abs().max().item() for k in split_grads) <= 1e-6
