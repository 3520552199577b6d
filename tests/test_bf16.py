"""bf16 on CPU: `train.bf16: true` (autocast over fp32 weights) and `model.dtype: bfloat16` (bf16 weights) train SFT and
DPO, LoRA and full, dense and MoE, along the fp32 run of the same recipe (per-step losses within BF16_LOSS_TOLERANCE);
the LM head's log-probs accumulate in fp32; packed rows
match each sample run alone within the bf16 tolerance measured here.

torch autocasts to bf16 on CPU; transformers accepts `bf16` without a GPU only with `use_cpu`, which
`training_args` sets. Tolerances: see each test (bf16 keeps 8 bits of mantissa, so about 2-3 significant digits).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from erniekit_lite.cli import main
from helpers import write_recipe

ROOT = Path(__file__).resolve().parents[1]
IDENTITY = ROOT / "recipes" / "data" / "identity.jsonl"
PAIRS = ROOT / "recipes" / "data" / "identity_dpo.jsonl"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU bf16 paths; a GPU run takes the CUDA ones")


def _recipe(tmp_path: Path, model_dir: Path, method: str, lora: bool, precision: str) -> Path:
    train = {"learning_rate": 3e-3 if method == "sft" else 5e-3, "max_steps": 15, "per_device_train_batch_size": 2,
             "activation_checkpointing": False, "logging_steps": 5, "save_strategy": "no", "seed": 0}
    if method == "dpo":
        train["beta"] = 0.1
    if precision == "autocast":
        train["bf16"] = True
    return write_recipe(tmp_path / "recipe.yaml", model_dir, method=method, model={"dtype": "bfloat16" if precision == "weights" else "float32"},
                        lora={"r": 8, "alpha": 16, "dropout": 0.0} if lora else None, train=train)


CASES = [
    ("sft", "dense", True, "autocast"),
    ("sft", "dense", True, "weights"),
    ("sft", "dense", False, "autocast"),
    ("sft", "moe", True, "weights"),
    ("sft", "moe", False, "autocast"),
    ("dpo", "dense", True, "autocast"),
    ("dpo", "dense", False, "weights"),
    ("dpo", "moe", True, "weights"),
]


# |bf16 - fp32| of a logged loss over 15 steps may be at most 5% of the fp32 loss plus 0.005 (DPO's loss falls to
# ~0.003, where bf16's rounding is a larger share: measured 0.0003 there; 2e-3 relative elsewhere)
BF16_LOSS_TOLERANCE = (0.05, 0.005)


def _losses(out: Path) -> list[float]:
    return [h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory, tiny_own_dir, tiny_moe_dir):
    """The fp32 run of a case's recipe (same data, seed and steps), made once per (method, arch, lora)."""
    runs = {}

    def losses(method: str, arch: str, lora: bool) -> list[float]:
        if (method, arch, lora) not in runs:
            where = tmp_path_factory.mktemp(f"fp32-{method}-{arch}-{lora}")
            code = main(["train", str(_recipe(where, tiny_own_dir if arch == "dense" else tiny_moe_dir, method, lora, "fp32"))])
            assert code == 0
            runs[method, arch, lora] = _losses(where / "out")
        return runs[method, arch, lora]

    return losses


@pytest.mark.slow
@pytest.mark.parametrize("method,arch,lora,precision", CASES, ids=["-".join(map(str, c)).replace("True", "lora").replace("False", "full") for c in CASES])
def test_bf16_trains_on_cpu_along_the_fp32_run(tmp_path, capsys, tiny_own_dir, tiny_moe_dir, fp32_losses, method, arch, lora, precision):
    """bf16 follows the fp32 run of the same recipe step by step (a broken bf16 path, e.g. a head or a loss in bf16
    that loses the signal, or adapters cast away, leaves it), and the loss falls."""
    model_dir = tiny_own_dir if arch == "dense" else tiny_moe_dir
    reference = fp32_losses(method, arch, lora)
    code = main(["train", str(_recipe(tmp_path, model_dir, method, lora, precision))])
    out, err = capsys.readouterr()
    assert code == 0, err
    history = _losses(tmp_path / "out")
    assert len(history) == len(reference) == 3
    relative, absolute = BF16_LOSS_TOLERANCE
    worst = max(abs(b - f) - relative * abs(f) for b, f in zip(history, reference))
    print(f"bf16 vs fp32 losses: worst |difference| beyond {relative:.0%} of the fp32 loss: {worst:.3g}")
    assert worst <= absolute, (history, reference)
    assert history[-1] < 0.99 * history[0], history  # 15 steps: the loss falls (SFT by 2%), not converges
    # the run says which precision was in effect: autocast over fp32 weights, or bf16 weights without autocast
    distributed = json.loads((tmp_path / "out" / "train_results.json").read_text())["distributed"]
    assert distributed["mixed_precision"] == ("bf16 autocast" if precision == "autocast" else "none")
    assert (distributed["strategy"], distributed["world_size"], distributed["sharded_parameters"]) == ("single", 1, 0)
    # fp32 weights under autocast; bf16 weights otherwise (beside fp32 LoRA adapters and the MoE router)
    assert distributed["weights"] == "float32" if precision == "autocast" else "bfloat16" in distributed["weights"]
    assert f"mixed precision: {distributed['mixed_precision']} ({distributed['weights']} weights)" in out


def test_lm_head_log_probs_accumulate_in_fp32_from_bf16_logits():
    """A bf16 head: log-probs equal fp32 log_softmax of the same bf16 logits (not a bf16 log_softmax)."""
    from erniekit_lite.train.scoring import head_scores

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 5000, bias=False).to(torch.bfloat16).requires_grad_(False)
    hidden = (2 * torch.randn(40, 64)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 5000, (40,))
    token = head_scores(head, hidden, targets, False)[0]
    assert token.dtype == torch.float32
    logits = torch.nn.functional.linear(hidden.detach(), head.weight)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert (token.detach() - ref).abs().max().item() <= 1e-5
    bf16_way = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1).float()
    assert (bf16_way - ref).abs().max().item() > 1e-3  # what accumulating in bf16 would have lost


PACKED_LOGIT_TOLERANCE = 1e-2  # max |packed - alone| in bf16 logits; measured 0 on the tiny model (docs/performance.md)


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)], ids=["bf16-weights", "autocast"])
def test_packed_rows_equal_samples_alone_in_bf16(tiny_dense_dir, ernie_tokenizer, dtype, autocast):
    from erniekit_lite.data.collate import PackedCollator
    from erniekit_lite.data.formats import Conversation, Turn
    from erniekit_lite.data.packing import pack
    from erniekit_lite.data.template import template_for
    from erniekit_lite.data.tokenize import Tokenizer
    from erniekit_lite.model.load import load_model

    convs = [Conversation([Turn(f"Question {i}: " + "word " * (3 * i), "Answer " * (i + 2))]) for i in range(6)]
    samples, _ = Tokenizer(ernie_tokenizer, template_for(ernie_tokenizer))(convs, max_length=512)
    model = load_model(str(tiny_dense_dir), "bfloat16" if dtype == torch.bfloat16 else "float32", "packed_sdpa").eval()
    batch = PackedCollator(512)([vars(r) for r in pack(samples, 512)])
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    starts = batch["cu_seq_lens_q"].tolist()
    worst = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        packed = model(**{k: v for k, v in batch.items() if k not in ("labels", "token_slots")}, use_cache=False).logits[0].float()
        for k, i in enumerate(order):
            ids = torch.tensor([samples[i].input_ids])
            alone = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0].float()
            worst = max(worst, (packed[starts[k] : starts[k + 1]] - alone).abs().max().item())
    print(f"bf16 packed vs alone, max |logit difference|: {worst:.4g}")
    assert worst <= PACKED_LOGIT_TOLERANCE


AVX2_ONLY = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2\n"


def test_a_cpu_without_bf16_instructions_is_said(tmp_path, capsys, tiny_own_dir, monkeypatch):
    """On an AVX2-only CPU bf16 autocast trained 3 SFT steps ~27x slower than fp32 and validate only said "bf16
    autocast"; now validate (and train: the same run-plan lines) says it in one line with how to turn it off, read
    from the CPU's flags (stand-in /proc/cpuinfo texts here); not said for fp32 or a CPU with bf16."""
    from erniekit_lite import run_plan

    assert not run_plan.cpu_has_bf16(AVX2_ONLY)
    assert run_plan.cpu_has_bf16(AVX2_ONLY.replace("bmi2", "bmi2 avx512f avx512_bf16"))
    assert run_plan.cpu_has_bf16(AVX2_ONLY.replace("bmi2", "amx_bf16 amx_tile"))
    assert run_plan.cpu_has_bf16("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")  # Arm (Graviton3, Apple M2)
    assert not run_plan.cpu_has_bf16("processor\t: 0\nFeatures\t: fp asimd\n")
    assert run_plan.cpu_has_bf16("")  # unreadable: no note rather than a wrong one
    recipe = _recipe(tmp_path, tiny_own_dir, "sft", True, "autocast")
    said = f"  note: {run_plan.SLOW_BF16}"
    for has_bf16, overrides, shown in ((False, [], True), (True, [], False), (False, ["train.bf16=false"], False)):
        monkeypatch.setattr(run_plan, "cpu_has_bf16", lambda has=has_bf16: has)
        assert main(["validate", str(recipe), *overrides]) == 0
        assert (said in capsys.readouterr().out.splitlines()) == shown, (has_bf16, overrides)
