"""Where a model comes from: a local folder or a Hugging Face Hub id, an adapter's base, the folder its tokenizer is
read from, its config.json; each way one can be missing said in one line. Reads no weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from erniekit_lite.errors import UserError


@dataclass(frozen=True)
class Source:
    """A model path as located once: `base` the adapter's base (None: not an adapter), `tokenizer` the folder or id the
    tokenizer loads from, `config` the model's (or the base's) config.json."""

    path: str
    base: str | None
    tokenizer: str
    config: object

    @property
    def weights(self) -> str:
        """Where the base weights load from."""
        return self.base or self.path


def locate(path: str, trust_remote_code: bool = False) -> Source:
    """`path` (a recipe's model.path) located: is it an adapter, where its tokenizer is, its config (the base's)."""
    base = adapter_base(path)
    return Source(path, base, tokenizer_path(path), read_config(base or path, trust_remote_code))


def adapter_base(path: str) -> str | None:
    """The base model of a LoRA output dir, or None when `path` is not an adapter."""
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text())["base_model_name_or_path"]


def trained_in_4bit(run_dir: str) -> str | None:
    """For a QLoRA run dir (its recipe.yaml has model.load_in_4bit: true), the dtype its unquantized weights had."""
    import yaml

    recipe = Path(run_dir).expanduser() / "recipe.yaml"
    if not recipe.is_file():
        return None
    model = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("model") or {}
    return model.get("dtype", "float32") if model.get("load_in_4bit") else None


def sentencepiece_file(tokenizer: str) -> Path | None:
    """The sentencepiece `tokenizer.model` of a tokenizer folder , or of a Hub id (downloaded into the Hugging Face
    cache, or read from there offline); None when it has none."""
    if Path(tokenizer).expanduser().is_dir():
        found = Path(tokenizer).expanduser() / "tokenizer.model"
        return found if found.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(tokenizer, "tokenizer.model"))
    except (EntryNotFoundError, LocalEntryNotFoundError):
        return None


def tokenizer_path(model_path: str) -> str:
    # An adapter dir saved by us carries the tokenizer; a bare adapter falls back to its base
    if adapter_base(model_path) and not (Path(model_path) / "tokenizer_config.json").is_file():
        return adapter_base(model_path)
    return model_path


# What a model folder holds, and which command needs what (said by the errors for a folder that lacks a part)
VOCABULARY_FILES = ("tokenizer.model", "tokenizer.json", "vocab.json", "vocab.txt")  # sentencepiece, tokenizers, BPE, WordPiece
TOKENIZER_FILES = (*VOCABULARY_FILES, "tokenizer_config.json")
MODEL_FOLDER = ("`validate` needs only config.json for its memory plan, the tokenizer (tokenizer.model, tokenizer_config.json, "
                "added_tokens.json and special_tokens_map.json as released, or a tokenizer.json) to read the data, and "
                "`train` the weights (*.safetensors) too")


def has_tokenizer(path: str) -> bool:
    """False for a local folder holding none of TOKENIZER_FILES (a config-only copy of a release); a Hub id, or a
    folder with some of them, is left to `load_tokenizer` to answer."""
    local = Path(path).expanduser()
    return not local.is_dir() or any((local / name).is_file() for name in TOKENIZER_FILES)


def read_config(path: str, trust_remote_code: bool = False):
    """The model's config.json (the model's or an adapter's base), each way it can be missing said in one line."""
    from transformers import AutoConfig

    folder = Path(path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():  # transformers: "Should have a `model_type` key"
        raise UserError(f"model.path: {path}: no config.json in this folder; {MODEL_FOLDER}")
    offline = "" if Path(path) == Path(QUICKSTART_MODEL) else "; offline, a folder holding the model's config.json is enough for the memory plan"
    try:
        check_source(path)  # an adapter's base may be a Hub id: one quick request, not from_pretrained's retries
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except UserError as e:  # no such folder, and a Hub id that cannot be one, that the Hub lacks, or no Hub to ask
        raise UserError(f"{e}{offline if UNREACHABLE in str(e) else ''}") from None
    except (OSError, ValueError) as e:
        missing = missing_source(path, e)
        if missing:
            raise UserError(f"{missing}{offline if UNREACHABLE in missing else ''}") from None
        raise UserError(f"model.path: {path}: could not read the model config: {one_line(e)}") from None
    return config


QUICKSTART_MODEL = "runs/tiny-ernie"  # recipes/quickstart*.yaml's model.path, written by `erniekit-lite tiny`


HUB_CHECK_TIMEOUT = 10  # seconds for the one metadata request that looks a missing local path up on the Hub
NOT_A_REPO_ID = "not a valid Hugging Face Hub repo id (ORG/NAME)"
UNREACHABLE = "the Hugging Face Hub could not be reached to look for a repo of that name"
NO_SUCH_REPO = "the Hugging Face Hub has no such repo (a private one needs `hf auth login`)"


def missing_source(path: str, error: Exception) -> str | None:
    """One line for a model path that is neither a local directory nor a reachable Hub repo (None otherwise).

    `runs/tiny-ernie` has a Hub id's shape, so a missing local dir is tried on the Hub first; the error from there
    ("couldn't connect") alone would hide that the directory does not exist. A path that cannot be a Hub id
    (`/nonexistent/model`, `./nope`) would otherwise surface as huggingface_hub's "Repo id must be in the form ..."."""
    if Path(path).expanduser().exists():
        return None
    if not _valid_repo_id(path):
        return _no_source(path, NOT_A_REPO_ID)
    text = str(error)
    if "couldn't connect" in text or "offline" in text.lower():
        return _no_source(path, UNREACHABLE)
    if "not a valid model identifier" in text or "404" in text or "Repository Not Found" in text:
        return _no_source(path, NO_SUCH_REPO)
    return None


def check_source(path: str, named: str = "model.path") -> None:
    """Before a load: a path that is no local directory is looked up on the Hub with one metadata request, no
    retries and a short timeout, and is a one-line UserError when it cannot be a repo id, the Hub has no such repo,
    or the Hub cannot be reached. Without this check `from_pretrained` retries an unreachable Hub five times per
    file (about 23 s each, a `Retrying in Ns` line per try) before the same answer. A repo already in the local
    Hugging Face cache, or HF_HUB_OFFLINE set, is left to `from_pretrained` (which reads the cache); so are answers
    that say nothing about the repo (a 5xx, say), for the download's own retries. `named`: what the path is called
    where the user gave it (a recipe key; "" for a command's own argument)."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    from erniekit_lite.retry import transport_error

    if Path(path).expanduser().exists():
        return
    if not _valid_repo_id(path):
        raise UserError(_no_source(path, NOT_A_REPO_ID, named))
    if constants.is_offline_mode() or any(
        isinstance(try_to_load_from_cache(path, name), str) for name in ("config.json", "tokenizer_config.json", "adapter_config.json")
    ):
        return
    try:
        HfApi().model_info(path, timeout=HUB_CHECK_TIMEOUT, expand=["sha"])
    except GatedRepoError:
        return  # it exists; from_pretrained says what access it needs
    except RepositoryNotFoundError:
        raise UserError(_no_source(path, NO_SUCH_REPO, named)) from None
    except transport_error():
        raise UserError(_no_source(path, UNREACHABLE, named)) from None
    except HfHubHTTPError:
        return


def _no_source(path: str, hub: str, named: str = "model.path") -> str:
    hint = ""
    if Path(path) == Path(QUICKSTART_MODEL):
        hint = f"; the quick start's tiny model is made by `erniekit-lite tiny {QUICKSTART_MODEL} --arch dense`"
    return f"{named + ': ' if named else ''}{path}: no such directory here, and {hub}{hint}"


def _valid_repo_id(path: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def one_line(error: Exception) -> str:
    """The whole message on one line: some of transformers' run over several lines, and the first alone stops
    mid-sentence ("Couldn't instantiate the backend tokenizer from one of: ")."""
    return " ".join(str(error).split()) or type(error).__name__
