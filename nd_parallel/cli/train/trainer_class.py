"""Axolotl's ``trainer_cls``: ``module.Class`` of a Trainer subclass used in place of the trainer the run builds
(Axolotl's AxolotlTrainer; transformers' Trainer here), for supervised fine-tuning, imported from the working
directory, then the YAML's folder (as Axolotl imports it by name). Everything nd_parallel adds (the layout, the
loss over the global batch, Axolotl's schedules and optimizers) is set on the instance, so a subclass that
overrides, e.g., ``create_optimizer`` or ``log`` keeps them; one that derives from Axolotl's own trainer needs
Axolotl's builder and is refused with the alternative.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from nd_parallel.config import ConfigError


@dataclass(kw_only=True)
class TrainerClassOptions:
    trainer_cls: str | None = None
    """module.Class of a transformers.Trainer subclass the run trains with (supervised fine-tuning)."""


def refusals(d: dict) -> list[str]:
    name = d.get("trainer_cls")
    if name is None:
        return []
    if not isinstance(name, str) or "." not in name.strip("."):
        return [f"trainer_cls={name!r}: write module.Class (a transformers.Trainer subclass in a module of the "
                "working directory or the YAML's folder)"]
    other = "rl" if d.get("rl") else "reward_model" if d.get("reward_model") or d.get("process_reward_model") else \
        "processor_type" if d.get("processor_type") else "diffusion" if d.get("diffusion") else None
    if other:
        return [f"trainer_cls with {other}: that run builds its own trainer (TRL's / the multimodal or diffusion "
                "one) here; drop trainer_cls"]
    return []


def load(name: str, dirs: list[str]):
    from transformers import Trainer

    from .grpo import importable

    module, _, attr = name.rpartition(".")
    with importable(dirs):
        cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"{name} is not a transformers.Trainer subclass")
    if any(c.__module__.split(".")[0] == "axolotl" for c in cls.__mro__):
        raise TypeError(f"{name} derives from Axolotl's trainer, which nd-parallel train does not build")
    return cls


def check(cfg, path) -> None:
    """Before any rank starts: the class imports and is a plain Trainer subclass; the ranks import it from the same
    folders (cfg.import_dirs)."""
    if not cfg.trainer_cls:
        return
    from .grpo import user_dirs

    dirs = cfg.import_dirs or user_dirs(path)
    try:
        load(cfg.trainer_cls, dirs)
    except Exception as err:  # the user's module: any import error, named
        raise ConfigError(f"{path}: trainer_cls={cfg.trainer_cls!r} cannot be used: {err}; point it at a "
                          "transformers.Trainer subclass (module.Class) in the working directory or the YAML's "
                          "folder, or run the YAML with Axolotl and the nd_parallel plugin") from None
    cfg.import_dirs = dirs


def trainer_base(t):
    """The class the supervised run builds: the YAML's trainer_cls, else transformers' Trainer."""
    from transformers import Trainer

    return load(t.trainer_cls, t.import_dirs) if t.trainer_cls else Trainer
