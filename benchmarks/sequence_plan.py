"""What the shipped long-context recipes need per GPU with each row split over N processes
(`distributed.sequence_parallel`): `validate`'s per-device plan for N = 1, 2, 4, with plain data parallelism
(DDP: every process holds the model) and with FSDP2 over the same N processes (the model sharded too), and the
smallest GPU size validate names (24 / 48 / 80 / 141 GB) each fits. Plans only: the released configs (../shared)
and the real tokenizer, the model built on the meta device; nothing trains.

    python benchmarks/sequence_plan.py
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ERNIEKIT_SHARED", str(ROOT.parent / "shared")))
RECIPES = ("ernie-4.5-0.3b/sft-32k.yaml", "ernie-4.5-21b-a3b-thinking/sft-lora-32k.yaml",
           "ernie-4.5-21b-a3b-thinking/sft-lora-128k.yaml")


def main() -> int:
    from erniekit_lite import memory, recipe as recipes
    from erniekit_lite.plan import plan
    from erniekit_lite.run_plan import Launch

    tokenizer = SHARED / "ernie45" / "ernie-4.5-0.3b-base-pt"
    with tempfile.TemporaryDirectory() as tmp:
        moe = Path(tmp) / "21b"  # the released MoE config beside the (shared) ERNIE 4.5 tokenizer
        shutil.copytree(tokenizer, moe, ignore=shutil.ignore_patterns("config.json"))
        shutil.copy(SHARED / "ernie45" / "ernie-4.5-21b-a3b-pt" / "config.json", moe / "config.json")
        print("recipe | N | DDP: GiB per GPU (fits) | FSDP2 over N: GiB per GPU (fits)")
        for name in RECIPES:
            path = tokenizer if name.startswith("ernie-4.5-0.3b") else moe
            for n in (1, 2, 4):
                recipe = recipes.load(str(ROOT / "recipes" / name), [f"model.path={path}", f"output.dir={tmp}/out",
                                                                     f"distributed.sequence_parallel={n}"])
                lines: list[str] = []
                info = plan(recipe, log=lines.append, launch=Launch("fsdp", n) if n > 1 else None)
                whole = info["memory_gb"]  # one process's whole plan (DDP holds it all on each GPU)
                fsdp = info.get("memory_gb_sharded", whole)

                def fit(gib: float) -> str:
                    gpu = memory.smallest_gpu(int(gib * memory.GIB))
                    return f"{gpu} GB" if gpu else "none listed"

                print(f"{name} | {n} | {whole:.1f} ({fit(whole)}) | {fsdp:.1f} ({fit(fsdp)})", flush=True)
    print("FSDP2 figures are validate's rough sharded ones (the sharded states plus three gathered layers); N = 1 is "
          "one process without sharding in both columns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
