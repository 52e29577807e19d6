"""Models for pstar_fx: a GPT with PatrickStar's size table and a LLaMA-style model."""
