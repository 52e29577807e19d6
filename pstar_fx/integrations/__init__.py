"""integrations: pstar_fx inside other training libraries, each in its own module, each behind its own extra.

  lightning.py   `PstarStrategy`, `Trainer(strategy="pstar_fx")` (pip install pstar_fx[lightning])

Nothing here is imported by `import pstar_fx`: a module is imported when it is used, and it needs its library.
"""
