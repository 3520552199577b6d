"""erniekit-lite: fine-tune ERNIE 4.5 from YAML recipes on transformers, peft and TRL."""

__version__ = "0.1.0"

import logging as _logging

# bitsandbytes (installed for QLoRA) warns at import that its optional CPU 4-bit kernel, fetched from the Hub by the
# `kernels` package, is missing; it then dequantizes and runs a plain matmul (same result). Said once in docs/moe.md
# (QLoRA), not in every command's output.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
# DeepSpeed (installed for ZeRO-3), imported by TRL on a machine without a GPU, warns that it found none: the run's
# own `distributed:` line says where it trains. A filter on its logger survives DeepSpeed setting the logger up.
_logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to CPU" not in record.getMessage())

import warnings as _warnings

# peft 0.21 and TRL 1.16 read transformers' deprecated `is_gradient_checkpointing` (5.23 renamed it
# `is_activation_checkpointing`): a FutureWarning in most commands about code that is not ours and changes nothing
_warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
# TRL 1.16's configs set the old `gradient_checkpointing` field, which transformers 5.23 maps to
# `activation_checkpointing` with a FutureWarning on every config built (validate and train printed it): not the user's
_warnings.filterwarnings("ignore", message=r"`gradient_checkpointing` is deprecated", category=FutureWarning)
