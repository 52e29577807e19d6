"""integrations: pstar_fx behind the training loops people already use, one module per ecosystem, each behind
its own extra.

  transformers.py  `PstarTrainer`: a `transformers.Trainer` (and, as a mixin, TRL's `SFTTrainer`) whose step is the
                   engine's (pip install pstar_fx[hf]; TRL: pstar_fx[trl])
  lightning.py     `PstarStrategy`, `Trainer(strategy="pstar_fx")` (pip install pstar_fx[lightning])

Each module imports its ecosystem when it is imported, never here, so `import pstar_fx` does not need them.
"""
