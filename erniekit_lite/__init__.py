"""erniekit-lite: fine-tune ERNIE 4.5 from YAML recipes on transformers, peft and TRL."""

__version__ = "0.1.0"
