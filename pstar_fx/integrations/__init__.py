"""integrations: pstar_fx behind the training loops people already use, one module per ecosystem.

  transformers.py  PstarTrainer: a `transformers.Trainer` (and, as a mixin, TRL's `SFTTrainer`) whose step is the
                   engine's. Needs the `hf` extra.

Each module imports its ecosystem when it is imported, never here, so `import pstar_fx` does not need them.
"""
